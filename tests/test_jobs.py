"""The cluster scripts: valid bash, the exact per-node commands of a dry run, and the checkout found from a copy."""

import os
import shutil
import signal
import subprocess
import sys
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
UNTIL_STOPPED = f"bash {ROOT}/jobs/until_stopped.sh"  # a Ray node's `ray start --block`, stopped with the job
NO_STATS_4 = "--num-gpus=4 --disable-usage-stats"


def test_capture_dry_run_starts_ray_then_pipeline():
    lines = dry_run(
        "slurm_capture.sbatch",
        "model=qwen3-8b",
        "data=nemotron",
        SLURM_JOB_NODELIST="gpu1,gpu2,gpu3",
        GPUS_PER_NODE="4",
    )
    assert lines == [
        f"[gpu1] {UNTIL_STOPPED} {RAY} start --head --node-ip-address=gpu1 --port=6379 {NO_STATS_4} --block",
        f"[gpu2] {UNTIL_STOPPED} {RAY} start --address=gpu1:6379 --node-ip-address=gpu2 {NO_STATS_4} --block",
        f"[gpu3] {UNTIL_STOPPED} {RAY} start --address=gpu1:6379 --node-ip-address=gpu3 {NO_STATS_4} --block",
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
    resources = "--num-gpus=0 --num-cpus=6 --disable-usage-stats --object-store-memory=100000000"
    head = f"--head --node-ip-address=c1 --port=7000 {resources} --include-dashboard=false"
    assert lines == [
        f"[c1] {UNTIL_STOPPED} {RAY} start {head} --block",
        f"[c2] {UNTIL_STOPPED} {RAY} start --address=c1:7000 --node-ip-address=c2 {resources} --block",
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


# exits 1 on SIGTERM after shutting down, as `ray start --block` does (ray._private.node's SIGTERM handler)
RAY_LIKE = (
    "import signal, sys, time\n"
    "def stop(*_):\n"
    "    time.sleep(0.5)\n"
    "    open(sys.argv[1], 'w').write('shut down')\n"
    "    sys.exit(1)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_step_stopped_by_the_job_exits_0_once_its_command_has_shut_down(tmp_path):
    """jobs/until_stopped.sh: the SIGTERM the job's end sends to a Ray node's step (all its processes, as slurmstepd
    does) is a success, so srun reports no failed task in a completed job's log; it waits for the command first."""
    marker = tmp_path / "shut-down"
    step = subprocess.Popen(
        ["bash", str(ROOT / "jobs" / "until_stopped.sh"), sys.executable, "-c", RAY_LIKE, str(marker)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert step.stdout.readline() == "up\n"
    os.killpg(step.pid, signal.SIGTERM)
    assert step.wait(timeout=30) == 0
    assert marker.read_text() == "shut down"


@pytest.mark.parametrize("code", [0, 3])
def test_a_step_that_ends_by_itself_keeps_its_exit_code(code):
    cmd = ["bash", str(ROOT / "jobs" / "until_stopped.sh"), sys.executable, "-c", f"raise SystemExit({code})"]
    assert subprocess.run(cmd, timeout=60).returncode == code


def test_ray_fits_counts_the_actors_each_node_holds():
    """jobs/ray_fits.py's arithmetic: an actor needs all its CPUs and GPUs on one node."""
    sys.path.insert(0, str(ROOT / "jobs"))
    try:
        from ray_fits import actors_that_fit, describe
    finally:
        sys.path.remove(str(ROOT / "jobs"))
    nodes = [{"CPU": 16.0, "GPU": 8.0}, {"CPU": 6.0, "GPU": 8.0}, {"CPU": 1.0}]
    assert actors_that_fit(nodes, cpus=2, gpus=1) == 8 + 3 + 0
    assert actors_that_fit(nodes, cpus=4, gpus=1) == 4 + 1 + 0
    assert actors_that_fit(nodes, cpus=1, gpus=0) == 16 + 6 + 1
    assert actors_that_fit([{"CPU": 1.0}, {"CPU": 1.0}], cpus=4, gpus=1) == 0
    assert describe([{"CPU": 1.0}, {"CPU": 1.0, "GPU": 0.0}]) == "2 nodes with 1 CPUs and 0 GPUs"


# A GPU partition as `sinfo` shows it (a stand-in on PATH: no Slurm with GPUs here): node, CPUs, GRES.
SINFO = """#!/usr/bin/env bash
case "$*" in
    *-N*) printf '%s\\n' 'g1 64 gpu:a100:8(S:0-1)' 'g2 64 gpu:a100:8(S:0-1)' 'g3 16 gpu:a100:4,gpu:v100:4' \\
        'c1 128 (null)' ;;
    *) printf '%s\\n' 'gpu*' ;;
esac
"""


def submit_dry(tmp_path, **env):
    (tmp_path / "sinfo").write_text(SINFO)
    (tmp_path / "sinfo").chmod(0o755)
    full_env = {**os.environ, "DRY_RUN": "1", "PATH": f"{tmp_path}:/usr/bin:/bin", **env}
    cmd = ["bash", str(ROOT / "jobs" / "slurm_submit.sh"), "capture", "model=qwen3-8b"]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True)


@pytest.mark.parametrize(
    "nodes, cpus, gpus",
    [("2", 64, 8), ("3", 16, 8), ("4", 16, 0)],
)
def test_submit_defaults_to_what_nodes_nodes_of_the_partition_have(tmp_path, nodes, cpus, gpus):
    """GPUs first (the most that NODES nodes have; a node's GPU GRES summed), then the CPUs of the nodes with them."""
    out = submit_dry(tmp_path, NODES=nodes)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(
        f"GPUS_PER_NODE={gpus} sbatch --parsable --nodes={nodes} --cpus-per-task={cpus} --gpus-per-node={gpus} "
        f"--partition=gpu --output={ROOT}/logs/%x-%j.out {ROOT}/jobs/slurm_capture.sbatch model=qwen3-8b"
    )


def test_submit_refuses_cpus_no_node_with_the_gpus_has(tmp_path):
    out = submit_dry(tmp_path, NODES="2", CPUS_PER_NODE="100")
    assert out.returncode == 1 and out.stdout == ""
    assert "refused, nothing submitted: partition gpu has no 2 nodes with 100 CPUs (CPUS_PER_NODE) and 8 GPUs" in (
        out.stderr
    )
    for kind in ("2 nodes with 64 CPUs and 8 GPUs (g1 g2)", "1 nodes with 16 CPUs and 8 GPUs (g3)", "(c1)"):
        assert kind in out.stderr
