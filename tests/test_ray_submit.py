"""jobs/ray_submit.sh as a user runs it: a real two-node Ray cluster on this machine (`ray start --head` with its job
server, the dashboard, on 127.0.0.1, and a second node), the job submitted through the script, the store checked.
Relative output paths are refused before a job is submitted, and by the pipeline inside a job."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flashdraft.store import StoreReader, read_manifest
from pipeline.job import load_records
from tests.test_cluster_local import RAY, free_port, stop_cluster
from tests.test_pipeline import build_tiny_target

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = str(Path(sys.executable).parent)
WHY = "relative: a Ray job runs in a copy of the working tree uploaded to the cluster"
SOURCES, LIMIT = ["humaneval", "mtbench"], 4  # data.sources, data.limit


@pytest.fixture(scope="module")
def ray_job_cluster():
    """(the job server's address, the environment). The nodes start from the activated environment, as the script's
    header asks: the job's `python` is the one on their PATH."""
    port, dashboard = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    path = f"{VENV_BIN}:{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    # every port its own: two nodes on one machine, maybe beside another cluster (a fixed default would collide)
    common = ["--num-cpus=1", "--disable-usage-stats", "--object-store-memory=100000000", "--node-ip-address=127.0.0.1"]
    head = [RAY, "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}", "--include-dashboard=true"]
    head += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}"]
    worker = [RAY, "start", f"--address=127.0.0.1:{port}"]
    try:
        for cmd in (head, worker):
            agent = f"--dashboard-agent-listen-port={free_port()}"
            subprocess.run([*cmd, *common, agent], env=env, check=True, capture_output=True, timeout=120)
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        stop_cluster(temp_dir, port)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(address: str, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    env = {**env, "RAY_ADDRESS": address, "NUM_ACTORS": "2"}
    cmd = ["bash", str(ROOT / "jobs" / "ray_submit.sh"), *overrides]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.cluster
def test_a_submitted_capture_writes_every_prompt_once_into_the_shared_store(tmp_path, ray_job_cluster):
    address, env = ray_job_cluster
    target = build_tiny_target(tmp_path / "target")
    run_dir = tmp_path / "run"
    out = submit(
        address,
        env,
        f"model.target={target}",
        "drafter.layer_ids=[0,1,2]",
        f"run_dir={run_dir}",
        "cluster.cpus_per_actor=1",
        "cluster.gpus_per_actor=0",
        f"data.sources=[{','.join(SOURCES)}]",
        f"data.limit={LIMIT}",
        "data.max_new_tokens=8",
        "data.shard_size=2",
        "data.batch_size=2",
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "succeeded" in out.stdout

    store = run_dir / "features"
    verify = subprocess.run([sys.executable, "-m", "pipeline", "verify", str(store)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
    records, _ = load_records(SOURCES, split="train", limit=LIMIT)
    seq_ids = StoreReader(store).seq_ids
    assert sorted(seq_ids) == sorted(r.seq_id for r in records)  # every prompt, each once
    assert read_manifest(store)["counts"]["sequences"] == len(records) == 8
    assert len(capture_nodes(address)) == 2  # one capture actor on each node wrote into the one store


def capture_nodes(address: str) -> set[str]:
    """The nodes the capture actors ran on (Ray's state API keeps dead actors for a while)."""
    from ray.util.state import list_actors

    actors = list_actors(address=address, filters=[("class_name", "=", "CaptureWorker")], detail=True)
    return {a.node_id for a in actors}


@pytest.mark.cluster
def test_a_job_given_relative_output_paths_is_refused_on_the_cluster(ray_job_cluster):
    """The pipeline's own check, for a job submitted without the script: its cwd is the uploaded copy."""
    address, env = ray_job_cluster
    cmd = [RAY, "job", "submit", f"--address={address}", f"--working-dir={ROOT}"]
    cmd += ['--runtime-env-json={"excludes": [".venv", "runs", ".git"]}', "--", "python", "-m", "pipeline"]
    cmd += ["cluster=ray", "cluster.ray_address=auto", "cluster.num_actors=1", "data.limit=1"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert f"features_dir=runs/smollm2-135m/features, run_dir=runs/smollm2-135m are {WHY}" in out.stdout


def test_ray_submit_refuses_relative_output_paths_before_submitting():
    env = {**os.environ, "RAY_ADDRESS": "http://127.0.0.1:9"}  # nothing listens: nothing may be submitted
    cmd = ["bash", str(ROOT / "jobs" / "ray_submit.sh"), "model=qwen3-8b", "features_dir=/shared/features"]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"error: run_dir=runs/qwen3-8b is {WHY}" in out.stderr
    assert "run_dir=/shared/runs/qwen3-8b" in out.stderr  # what to give instead
    assert out.stdout == ""  # `ray job submit` never ran
