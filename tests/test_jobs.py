"""The cluster scripts: valid bash, and the exact per-node commands of a dry run."""

import os
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


def test_capture_dry_run_starts_ray_then_pipeline():
    lines = dry_run(
        "slurm_capture.sbatch",
        "model=qwen3-8b",
        "data=nemotron",
        SLURM_JOB_NODELIST="gpu1,gpu2,gpu3",
        GPUS_PER_NODE="4",
    )
    py, ray = f"{ROOT}/.venv/bin/python", f"{ROOT}/.venv/bin/ray"
    assert lines == [
        f"[gpu1] {ray} start --head --node-ip-address=gpu1 --port=6379 --num-gpus=4 --block",
        f"[gpu2] {ray} start --address=gpu1:6379 --num-gpus=4 --block",
        f"[gpu3] {ray} start --address=gpu1:6379 --num-gpus=4 --block",
        f"[gpu1] env RAY_ADDRESS=gpu1:6379 {py} -m pipeline cluster=slurm cluster.ray_address=gpu1:6379 "
        "cluster.num_actors=12 cluster.gpus_per_actor=1 model=qwen3-8b data=nemotron",
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
    py = f"{ROOT}/.venv/bin/python"
    common = (
        "--nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=a:29500 --rdzv-id=42 "
        "-m trainer model=qwen3-8b train=paper"
    )
    assert lines == [f"[a] {py} -m torch.distributed.run {common}", f"[b] {py} -m torch.distributed.run {common}"]


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
