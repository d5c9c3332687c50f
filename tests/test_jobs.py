"""The cluster scripts: valid bash, the exact per-node commands of a dry run, and the checkout found from a copy."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "jobs").glob("*.sbatch")) + sorted((ROOT / "jobs").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def dry_run(script, *args, **env):
    full_env = {**os.environ, "DRY_RUN": "1", "PATH": "/usr/bin:/bin", **env}
    out = subprocess.run(
        ["bash", str(ROOT / "jobs" / script), *args], env=full_env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()


PY, RAY = f"{ROOT}/.venv/bin/python", f"{ROOT}/.venv/bin/ray"


def test_capture_dry_run_starts_ray_then_pipeline():
    lines = dry_run(
        "slurm_capture.sbatch",
        "model=qwen3-8b",
        "data=nemotron",
        SLURM_JOB_NODELIST="gpu1,gpu2,gpu3",
        GPUS_PER_NODE="4",
    )
    assert lines == [
        f"[gpu1] {RAY} start --head --node-ip-address=gpu1 --port=6379 --num-gpus=4 --block",
        f"[gpu2] {RAY} start --address=gpu1:6379 --node-ip-address=gpu2 --num-gpus=4 --block",
        f"[gpu3] {RAY} start --address=gpu1:6379 --node-ip-address=gpu3 --num-gpus=4 --block",
        f"[gpu1] env RAY_ADDRESS=gpu1:6379 {PY} -m pipeline cluster=slurm cluster.ray_address=gpu1:6379 "
        "cluster.num_actors=12 cluster.gpus_per_actor=1 model=qwen3-8b data=nemotron",
    ]


def test_capture_dry_run_on_cpu_nodes_one_actor_per_node_with_the_steps_cpus():
    lines = dry_run(
        "slurm_capture.sbatch",
        "data=local",
        SLURM_JOB_NODELIST="c1,c2",
        GPUS_PER_NODE="0",
        SLURM_CPUS_PER_TASK="6",
        RAY_PORT="7000",
        RAY_START_ARGS="--object-store-memory=100000000",
        RAY_HEAD_ARGS="--include-dashboard=false",
    )
    resources = "--num-gpus=0 --num-cpus=6 --object-store-memory=100000000"
    assert lines == [
        f"[c1] {RAY} start --head --node-ip-address=c1 --port=7000 {resources} --include-dashboard=false --block",
        f"[c2] {RAY} start --address=c1:7000 --node-ip-address=c2 {resources} --block",
        f"[c1] env RAY_ADDRESS=c1:7000 {PY} -m pipeline cluster=slurm cluster.ray_address=c1:7000 "
        "cluster.num_actors=2 cluster.gpus_per_actor=0 cluster.cpus_per_actor=6 data=local",
    ]


def test_train_dry_run_one_torchrun_per_node():
    lines = dry_run(
        "slurm_train.sbatch",
        "model=qwen3-8b",
        "train=paper",
        SLURM_JOB_NODELIST="a,b",
        SLURM_JOB_ID="42",
        GPUS_PER_NODE="8",
    )
    common = "--nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=a:29500 --rdzv-id=42"
    assert lines == [
        f"[{n}] {PY} -m torch.distributed.run {common} --local-addr={n} -m trainer model=qwen3-8b train=paper"
        for n in "ab"
    ]


def test_train_dry_run_on_cpu_nodes_one_rank_per_node():
    lines = dry_run("slurm_train.sbatch", "train.max_steps=3", SLURM_JOB_NODELIST="a,b", GPUS_PER_NODE="0")
    assert [line.split(" -m trainer ")[1] for line in lines] == ["device=cpu train.max_steps=3"] * 2
    assert all("--nproc-per-node=1 " in line for line in lines)


@pytest.mark.parametrize("script", ["slurm_capture.sbatch", "slurm_train.sbatch"])
def test_batch_script_run_from_a_copy_finds_the_checkout(script, tmp_path):
    """Slurm runs a copy of the script from its spool directory: the checkout is the submit directory (or
    FLASHDRAFT_ROOT), not the script's own folder, and without either it says so."""
    copy = tmp_path / "slurm_script"
    shutil.copy(ROOT / "jobs" / script, copy)
    env = {k: v for k, v in os.environ.items() if k != "FLASHDRAFT_ROOT"}
    env.update(DRY_RUN="1", SLURM_JOB_NODELIST="n1,n2", GPUS_PER_NODE="1")
    for where in ({"SLURM_SUBMIT_DIR": str(ROOT)}, {"SLURM_SUBMIT_DIR": "/", "FLASHDRAFT_ROOT": str(ROOT)}):
        out = subprocess.run(["bash", str(copy)], env={**env, **where}, capture_output=True, text=True)
        assert out.returncode == 0 and f"{ROOT}/.venv/bin/" in out.stdout, out.stderr
    lost = subprocess.run(["bash", str(copy)], env={**env, "SLURM_SUBMIT_DIR": "/"}, capture_output=True, text=True)
    assert lost.returncode != 0 and "no jobs/common.sh in /" in lost.stderr and "FLASHDRAFT_ROOT" in lost.stderr


def test_ray_submit_needs_address_and_passes_overrides():
    lines = dry_run(
        "ray_submit.sh",
        "model=qwen3-4b",
        "run_dir=/shared/runs/qwen3-4b",
        RAY_ADDRESS="http://head:8265",
        SLURM_JOB_NODELIST="me",
        NUM_ACTORS="16",
    )
    assert len(lines) == 1 and "job submit --address=http://head:8265" in lines[0]
    assert lines[0].endswith(
        "python -m pipeline cluster=ray cluster.ray_address=auto cluster.num_actors=16 model=qwen3-4b "
        "run_dir=/shared/runs/qwen3-4b"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    failed = subprocess.run(
        ["bash", str(ROOT / "jobs" / "ray_submit.sh")], env={**env, "DRY_RUN": "1"}, capture_output=True, text=True
    )
    assert failed.returncode != 0 and "RAY_ADDRESS" in failed.stderr
