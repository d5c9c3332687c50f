"""The cluster path without a cluster: a real multi-process Ray cluster on this machine (`ray start --head`
plus a second node process), and the pipeline run through the same `cluster=ray` config a cluster uses."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flashdraft.store import StoreReader, read_manifest, verify_store
from tests.test_pipeline import build_tiny_target

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_cluster():
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=1", "--disable-usage-stats", "--object-store-memory=100000000"]
    head = [
        RAY,
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=false",
        f"--temp-dir={temp_dir}",
        *common,
    ]
    worker = [RAY, "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1", *common]
    try:
        subprocess.run(head, env=env, check=True, capture_output=True, timeout=120)
        subprocess.run(worker, env=env, check=True, capture_output=True, timeout=120)
        yield f"127.0.0.1:{port}", env
    finally:
        stop_cluster(temp_dir, port)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_cluster(temp_dir: str, port: int) -> None:
    """Stop this test's two nodes only: `ray stop` would stop every Ray instance on the machine, a capture
    running beside the tests included. The nodes' processes name the temp dir or the head's address, and
    their workers and agents are children of those (the head reports its address by the machine's IP, not 127.0.0.1).
    Killed outright: the nodes and their folder go with the test, and the head's gcs_server and a Python process of
    its own outlast 25 s after a SIGTERM (a grace period would always run out)."""
    import psutil

    ours = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(temp_dir in a or a.endswith(f":{port}") for a in p.info["cmdline"] or ())
    ]
    family = {p.pid: p for p in ours}
    for p in ours:
        try:
            family.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for p in family.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(family.values()), timeout=20)


def test_pipeline_on_a_two_node_ray_cluster(tmp_path, ray_cluster):
    address, env = ray_cluster
    target = build_tiny_target(tmp_path / "target")
    store = tmp_path / "features"
    cmd = [
        sys.executable,
        "-m",
        "pipeline",
        "cluster=ray",
        f"cluster.ray_address={address}",
        "cluster.num_actors=2",
        "cluster.cpus_per_actor=1",
        "cluster.gpus_per_actor=0",
        f"model.target={target}",
        "drafter.layer_ids=[0,1,2]",
        f"features_dir={store}",
        f"run_dir={tmp_path / 'run'}",
        "data.sources=[humaneval,mtbench]",  # the offline default has more; the counts below are of these
        "data.limit=4",
        "data.max_new_tokens=8",
        "data.shard_size=2",
        "data.batch_size=2",
    ]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    problems, _ = verify_store(store, progress=False)
    assert problems == []
    reader = StoreReader(store)
    manifest = read_manifest(store)
    assert len(reader) == manifest["counts"]["sequences"] == 8  # 4 train prompts from each offline source
    assert len(set(reader.seq_ids)) == 8 and len(manifest["shards"]) == 4
