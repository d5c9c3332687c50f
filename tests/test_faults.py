"""Faults a user meets: who can reach a capture's Ray, what a killed driver leaves behind, what a planted
checkpoint or manifest can do."""

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from flashdraft.prompts import load_prompts
from flashdraft.store import StoreError, StoreReader, read_manifest, verify_store, write_store
from flashdraft.store.files import MANIFEST
from pipeline.fleet import FleetConfig, run_fleet
from pipeline.job import open_store
from tests.test_pipeline import build_tiny_target, settings_for
from tests.test_store import make_sequences, small
from tests.test_trainer_fixtures import metrics, tiny_store, tiny_target, train_here, train_kwargs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack socket
    return (mapped or addr).is_loopback


def listening(pids) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of `pids`."""
    pids, out = set(pids), []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.Error:
                name = "?"
            out.append((name, c.laddr.ip, c.laddr.port))
    return out


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def capture(store, target, on_result=None):
    """A local capture as `python -m pipeline` runs it: the fleet starts (and stops) its own Ray."""
    settings = settings_for(target, torch_threads=1)
    writer = open_store(store, settings, sources=["test"], store_options=dict(shard_tokens=256, chunk_tokens=32))
    fleet = FleetConfig(num_actors=1, shard_size=2)
    records = load_prompts("humaneval", limit=4)
    return run_fleet(store, records, settings, writer, fleet, on_result=on_result, progress=False)


def test_local_capture_listens_on_loopback_only_and_stops_every_ray_process(tmp_path, target):
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    seen = {}

    def look(result):  # while Ray is up: the driver and every process it started (gcs, raylet, agents, workers)
        if not seen:
            procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
            seen["procs"] = procs
            seen["listening"] = listening(p.pid for p in procs)

    summary = capture(tmp_path / "store", target, on_result=look)
    assert summary.sequences == 4 and not summary.failed
    names = {name for name, _, _ in seen["listening"]}
    assert {"gcs_server", "raylet"} <= names, seen["listening"]
    off = [s for s in seen["listening"] if not loopback(s[1])]
    assert not off, f"listening off loopback: {off}"
    left = [p for p in seen["procs"][1:] if running(p)]
    assert not left, f"Ray processes left after the run: {left}"
    assert not ray.is_initialized()


DRIVER = """
import os, signal, sys, psutil
sys.path.insert(0, {repo!r})
from tests.test_faults import capture

def crash(result):
    # the tree as it is now, then the driver dies as under the OOM killer
    with open({pids!r}, "w") as f:
        f.write(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)))
    os.kill(os.getpid(), signal.SIGKILL)

capture({store!r}, {target!r}, on_result=crash)
"""


def test_a_sigkilled_driver_leaves_no_ray_process(tmp_path, target):
    pids_file = tmp_path / "pids"
    script = textwrap.dedent(DRIVER).format(
        repo=str(REPO), pids=str(pids_file), store=str(tmp_path / "store"), target=target
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    driver = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, timeout=300)
    assert driver.returncode == -signal.SIGKILL, driver.stderr.decode()[-3000:]
    procs = []
    for pid in pids_file.read_text().split():
        try:
            procs.append(psutil.Process(int(pid)))
        except psutil.NoSuchProcess:
            pass
    assert procs, "the driver started no process"
    deadline = time.time() + 20
    while time.time() < deadline:
        alive = [p for p in procs if running(p)]
        if not alive:
            break
        time.sleep(0.5)
    assert not alive, f"still running 20 s after the driver's SIGKILL: {[(p.pid, p.name()) for p in alive]}"


@pytest.mark.parametrize("name", ["../../etc", "/etc", "shard-00000/../../x", "shard-1", "shard-00000\n", 7, None])
def test_a_manifest_shard_name_that_is_not_a_shard_name_is_refused(tmp_path, name):
    store = tmp_path / "s"
    write_store(store, make_sequences(), **small())
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["shards"][0]["name"] = name
    (store / MANIFEST).write_text(json.dumps(manifest))
    for open_it in (read_manifest, StoreReader):
        with pytest.raises(StoreError, match=rf"{store / MANIFEST} is corrupt: shard name {re.escape(repr(name))} "):
            open_it(store)
    problems, _ = verify_store(store, progress=False)
    assert problems and repr(name) in problems[0]


class PlantedCode:
    """What a planted checkpoint file holds: unpickling it runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A store, a target and the training config of a run that saved a checkpoint at step 2 (ZeRO 1)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    target = tiny_target(tmp / "target")
    store = tiny_store(tmp / "store", target, n=24)
    run = tmp / "run"
    kw = train_kwargs(run, store.path, target, epochs=1, max_steps=2, checkpoint_every=2, eval_every=0, zero_stage=1)
    train_here(kw)
    return run, kw


@pytest.mark.parametrize("planted", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_resume_from_a_planted_checkpoint_file_refuses_it_and_runs_nothing(checkpointed, tmp_path, planted):
    run, kw = checkpointed
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    kw = {**kw, "out_dir": str(copy / "run"), "drafter_dir": str(copy / "drafter")}
    ckpt = copy / "run" / "checkpoints" / "step-00000002"
    marker = tmp_path / "marker"
    torch.save({"module": PlantedCode(marker)}, ckpt / planted)
    refused = train_here(kw, check=False)  # in this process: what the planted file would run is a `touch`
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "UnsafeCheckpoint" in out and f"{ckpt / planted}: refused to load" in out, out[-3000:]
    assert "posix.system" in out  # what it would have run
    assert not marker.exists()
    assert len(metrics(copy / "run")) == 2  # nothing trained after the refusal
