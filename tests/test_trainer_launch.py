"""`python -m trainer` on one machine with several GPUs runs one rank per GPU (torchrun, started by the trainer
itself). No GPU here: the choice is tested for the GPU counts a machine may show, and the command it runs is run
(with --help, two ranks on the CPU) to show torchrun takes it."""

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.launch import local_ranks, torchrun_command

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("device", ["auto", "cuda", "CUDA"])
def test_several_gpus_and_no_launcher_start_one_rank_per_gpu(device):
    assert local_ranks({}, 8, device) == 8
    assert local_ranks({"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_JOB_ID": "7"}, 2, device) == 2  # sbatch'd, not srun'd


@pytest.mark.parametrize(
    "env,gpus,device,sweep",
    [
        ({}, 0, "auto", False),  # no GPU: the CPU run as before
        ({}, 1, "auto", False),  # one GPU: nothing to launch
        ({}, 8, "cpu", False),  # train.device=cpu on a GPU machine
        ({}, 8, "auto", True),  # one job of a Hydra sweep
        ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0"}, 8, "auto", False),  # torchrun's rank already
        ({"LOCAL_RANK": "3"}, 8, "cuda", False),  # deepspeed's launcher
        ({"OMPI_COMM_WORLD_SIZE": "8"}, 8, "auto", False),  # mpirun
        ({"SLURM_STEP_NUM_TASKS": "8"}, 8, "auto", False),  # one of an srun step's tasks
    ],
)
def test_otherwise_it_trains_right_here(env, gpus, device, sweep):
    assert local_ranks(env, gpus, device, sweep=sweep) == 1


def test_the_command_is_torchrun_standalone_over_the_same_arguments():
    command = torchrun_command(4, ["model=qwen3-8b", "train=paper", "train.lr=3e-4"])
    assert command == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "-m",
        "trainer",
        "model=qwen3-8b",
        "train=paper",
        "train.lr=3e-4",
    ]


def test_torchrun_runs_the_command(tmp_path):
    """The command as the trainer would exec it, with 2 ranks on the CPU and --help (each rank prints Hydra's help
    of `python -m trainer` and exits 0)."""
    out = subprocess.run(torchrun_command(2, ["--help"]), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("Powered by Hydra") == 2
