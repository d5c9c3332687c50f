"""jobs/ray_submit.sh as a user runs it: a real two-node Ray cluster on this machine (`ray start --head` with its job
server, the dashboard, on 127.0.0.1, and a second node), the job submitted through the script, the store checked.
Relative output paths are refused before a job is submitted, and by the pipeline inside a job."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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


def make_features(address: str, env: dict, *options: str, **popen) -> list[str] | subprocess.Popen:
    """`make features CLUSTER=ray` as a user runs it against the cluster (-o: the .venv is not rebuilt here)."""
    cmd = ["make", "--no-print-directory", "-o", ".venv/.installed", "features", "CLUSTER=ray", *options]
    return subprocess.Popen(cmd, env={**env, "RAY_ADDRESS": address}, cwd=ROOT, text=True, **popen)


def ray_jobs(address: str) -> dict[str, str]:
    from ray.job_submission import JobSubmissionClient

    return {j.submission_id: str(j.status) for j in JobSubmissionClient(address).list_jobs()}


@pytest.mark.cluster
def test_a_fleet_the_cluster_cannot_hold_is_refused_with_the_numbers(tmp_path, ray_job_cluster):
    """The defaults (8 actors of 1 GPU and 4 CPUs) on two 1-CPU nodes without GPUs: Ray would wait for ever."""
    address, env = ray_job_cluster
    before = ray_jobs(address)
    make = make_features(
        address, env, f"ARGS=run_dir={tmp_path / 'run'}", stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = make.communicate(timeout=300)
    assert make.returncode != 0, out + err
    assert (
        f"error: the Ray cluster at {address} (2 nodes with 1 CPUs and 0 GPUs) holds 0 of the 8 capture actors of "
        "4 CPUs and 1 GPUs each (cluster.num_actors=8, cluster.cpus_per_actor=4, cluster.gpus_per_actor=1)"
    ) in err
    assert ray_jobs(address) == before  # nothing submitted


STOP_WAIT = 20  # jobs/ray_submit.sh's default: the most it waits for `ray job stop` after Ctrl-C
EXIT_AFTER_STOP = STOP_WAIT + 25  # ... plus the log follower's 5 s and the `ray` CLI's start on a loaded machine


@pytest.mark.cluster
def test_stopping_make_stops_the_ray_job(tmp_path, ray_job_cluster):
    """Ctrl-C on `make features CLUSTER=ray` (SIGINT to its process group) stops the Ray job it submitted and
    returns within the script's bound; here a job whose driver waits for ever for GPU actors (submitted anyway:
    CHECK_FIT=0). The signal comes once the driver says it is asking for its actors, not after a fixed sleep."""
    address, env = ray_job_cluster
    target = build_tiny_target(tmp_path / "target")
    args = f"ARGS=run_dir={tmp_path / 'run'} model.target={target} drafter.layer_ids=[0,1,2] data.limit=2"
    make = make_features(
        address,
        {**env, "CHECK_FIT": "0"},
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        job = wait_for_job(address, make)
        os.killpg(make.pid, signal.SIGINT)
        signalled = time.monotonic()
        out, _ = make.communicate(timeout=EXIT_AFTER_STOP)
        took = time.monotonic() - signalled
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
    assert make.returncode != 0 and f"SIGINT: stopping Ray job {job}" in out, out[-3000:]
    assert ray_jobs(address)[job] == "STOPPED", (took, out[-3000:])  # `ray job stop` returned: the job had ended


def wait_for_job(address: str, make: subprocess.Popen, timeout: float = 240) -> str:
    """The submission id of the job `make` submitted, once its driver is connected to the cluster and asking for
    its capture actors (it prints the fleet it asks for: "capture fleet: ...")."""
    from ray.job_submission import JobSubmissionClient

    client, deadline = JobSubmissionClient(address), time.time() + timeout
    while time.time() < deadline:
        assert make.poll() is None, make.stdout.read()
        running = [k for k, v in ray_jobs(address).items() if re.match(r"flashdraft-capture-", k) and v == "RUNNING"]
        if running and "capture fleet:" in client.get_job_logs(running[0]):
            return running[0]
        time.sleep(1)
    raise TimeoutError(f"no flashdraft-capture job asking for its actors after {timeout} s")


FAKE_RAY = """#!/usr/bin/env bash
# `ray` as jobs/ray_submit.sh calls it, against a job that cannot end yet (PENDING: its driver not started): the log
# follower and `ray job stop` both wait for ever, as the real ones do for such a job
echo "$$ $*" >> "$FAKE_RAY_CALLS"
case "$1 $2" in
    "job submit") echo "Job submitted; tailing logs until the job exits"; exec sleep 600 ;;
    "job stop") echo "Job has not exited yet. Status: PENDING"; exec sleep 600 ;;
esac
exit 2
"""


def test_ctrl_c_returns_within_the_stop_wait_even_when_the_job_cannot_end_yet(tmp_path):
    """A job whose driver has not started (its runtime environment being set up, or no room for it) cannot be
    stopped until it starts, and `ray job stop` waits for that without a limit: the script cuts the wait at
    STOP_WAIT, says that Ray keeps the stop, ends the log follower and exits 130. No cluster needed: a fake `ray`."""
    fake, calls = tmp_path / "ray", tmp_path / "calls"
    fake.write_text(FAKE_RAY)
    fake.chmod(0o755)
    env = {**os.environ, "RAY": str(fake), "FAKE_RAY_CALLS": str(calls), "RAY_ADDRESS": "http://127.0.0.1:9"}
    env |= {"CHECK_FIT": "0", "STOP_WAIT": "3"}
    cmd = ["make", "--no-print-directory", "-o", ".venv/.installed", "features", "CLUSTER=ray"]
    cmd.append(f"ARGS=run_dir={tmp_path / 'run'}")
    make = subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (calls.is_file() and "job submit" in calls.read_text()):  # the log follower runs
            assert make.poll() is None and time.time() < deadline, make.stdout.read()
            time.sleep(0.2)
        os.killpg(make.pid, signal.SIGINT)
        signalled = time.monotonic()
        out, _ = make.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
    assert make.returncode != 0 and took < 3 + 10, (took, out[-3000:])
    assert "SIGINT: stopping Ray job flashdraft-capture-" in out
    assert "has not ended 3 s after the stop (a PENDING job ends as its driver starts): Ray keeps the stop" in out
    for line in calls.read_text().splitlines():  # the follower and the stop: both gone
        pid = int(line.split()[0])
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), line
