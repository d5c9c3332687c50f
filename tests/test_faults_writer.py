"""Faults of a store's writer, met as a user meets them: two captures into one store, the lock of a killed capture,
a shard folder that is not the task's, a commit that fails, a disk that fills. Real processes, a real tmpfs."""

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from flashdraft.prompts import load_prompts
from flashdraft.store import ShardWriter, StoreLayout, StoreReader, read_manifest, verify_store
from flashdraft.store.files import MANIFEST, SHARDS, WRITER_LOCK, shard_dir
from flashdraft.store.space import DiskFullError
from flashdraft.store.writer import StoreWriter
from pipeline.fleet import FleetConfig, run_fleet
from pipeline.job import load_records, open_store
from tests.test_pipeline import LAYERS, build_tiny_target, settings_for
from tests.test_store import make_sequences, small

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["humaneval"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def pipeline_cmd(target, store, limit, run_dir):
    """`python -m pipeline` on the tiny target, in-process (no Ray), two prompts a shard."""
    return [
        sys.executable,
        "-m",
        "pipeline",
        "cluster.num_actors=0",
        f"model.target={target}",
        f"drafter.layer_ids=[{','.join(map(str, LAYERS))}]",
        f"features_dir={store}",
        f"run_dir={run_dir}",
        f"data.sources=[{','.join(SOURCES)}]",
        "data.split=train",
        f"data.limit={limit}",
        "data.max_new_tokens=8",
        "data.shard_size=2",
        "data.batch_size=2",
        "data.store.shard_tokens=256",
        "data.store.chunk_tokens=32",
    ]


def env():
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}


def start(cmd) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(cmd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def command_here(*args) -> subprocess.CompletedProcess:
    """`python -m pipeline verify|repair|transcode ARGS` in this process: the command's function, whose return the
    entry's main exits with. For a test of what the command does and says, not of its process (a fresh one spends
    seconds on imports); a process runs each of them elsewhere (test_faults_store, test_faults_repair)."""
    from pipeline.__main__ import repair_command, transcode_command, verify_command

    command = {"verify": verify_command, "repair": repair_command, "transcode": transcode_command}[args[0]]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = command([str(a) for a in args[1:]])
    return subprocess.CompletedProcess(["pipeline", *map(str, args)], code, out.getvalue(), err.getvalue())


def wait_for_lock(store: Path, pid: int, proc: subprocess.Popen, timeout=180) -> dict:
    """The lock record once process `pid` holds the store's writer lock."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            record = json.loads((store / WRITER_LOCK).read_text() or "{}")
        except (OSError, ValueError):
            record = {}
        if record.get("pid") == pid:
            return record
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never took the writer lock of {store}")


def tree(store: Path) -> dict:
    """Every file of a store with its bytes: what a refused capture must leave as it was."""
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


def prompt_ids(limit) -> list[str]:
    records, _ = load_records(SOURCES, split="train", limit=limit)
    return sorted(r.seq_id for r in records)


def stored_once(store) -> list[str]:
    """The store's sequence ids, after checking that it verifies and holds each once."""
    assert verify_store(store, progress=False)[0] == []
    ids = StoreReader(store).seq_ids
    assert len(ids) == len(set(ids)), "a sequence is stored twice"
    return sorted(ids)


def leftovers(store: Path) -> list[str]:
    """Temporary shard folders and temporary manifest / rejects files."""
    temps = [p.name for p in (store / SHARDS).iterdir() if p.name.startswith(".tmp-")]
    return temps + [p.name for p in store.glob("*.tmp")]


def test_a_second_capture_into_a_store_is_refused_naming_the_first_and_nothing_is_lost(tmp_path, target):
    store, limit = tmp_path / "store", 12
    first = start(pipeline_cmd(target, store, limit, tmp_path / "run1"))
    try:
        holder = wait_for_lock(store, first.pid, first)
        os.kill(first.pid, signal.SIGSTOP)  # the first capture holds the lock mid-run, whatever the machine's speed
        before = tree(store)
        second = run(pipeline_cmd(target, store, limit, tmp_path / "run2"))
        assert tree(store) == before, "the refused capture changed the store"
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert second.returncode == 1
    assert f"is being written by another capture (host {socket.gethostname()}, pid {first.pid}, " in second.stderr
    assert f"started {holder['started']}; lock {store / WRITER_LOCK})" in second.stderr
    assert f"sequences {limit} ({limit} new)" in out
    assert stored_once(store) == prompt_ids(limit)
    again = run(pipeline_cmd(target, store, limit, tmp_path / "run3"))  # the lock is free once the first ends
    assert again.returncode == 0 and f"sequences {limit} (0 new)" in again.stdout, again.stderr[-3000:]
    assert stored_once(store) == prompt_ids(limit) and leftovers(store) == []


def test_the_lock_of_a_killed_capture_is_taken_over(tmp_path, target):
    store, limit = tmp_path / "store", 8
    dead = start(pipeline_cmd(target, store, limit, tmp_path / "run1"))
    record = wait_for_lock(store, dead.pid, dead)
    dead.kill()
    dead.communicate(timeout=60)
    assert json.loads((store / WRITER_LOCK).read_text())["pid"] == dead.pid  # the lock file names a dead process
    rerun = run(pipeline_cmd(target, store, limit, tmp_path / "run2"))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    took = (
        f"took over the lock {store / WRITER_LOCK} of an earlier capture (host {socket.gethostname()}, "
        f"pid {dead.pid}, started {record['started']}; no longer running)"
    )
    assert took in rerun.stderr
    assert stored_once(store) == prompt_ids(limit) and leftovers(store) == []
    assert (store / WRITER_LOCK).read_text() == ""  # a clean end leaves no holder behind


def fleet_run(store, target, records, on_result=None, writer_threads="auto"):
    settings = settings_for(target, max_new_tokens=8, writer_threads=writer_threads)
    writer = open_store(store, settings, sources=["test"], store_options=dict(shard_tokens=256, chunk_tokens=32))
    fleet = FleetConfig(num_actors=0, shard_size=2)
    return run_fleet(store, records, settings, writer, fleet, on_result=on_result, progress=False)


def plant_shard(store: Path, name: str, seed: int) -> set[str]:
    """A complete shard folder, never listed, holding sequences of no prompt of ours; returns its seq ids."""
    layout = StoreLayout.from_manifest(read_manifest(store))
    ids = [f"foreign-{seed}-{i}" for i in range(2)]
    with ShardWriter(store, name, layout) as shard:
        for i in ids:
            shard.append(i, [1, 2, 3], [False, True, True], torch.randn(3, len(LAYERS) * layout.hidden_size))
    return set(ids)


def test_a_shard_folder_of_other_sequences_is_never_adopted(tmp_path, target):
    store, records = tmp_path / "store", load_prompts("humaneval", limit=6)
    fleet_run(store, target, [])  # the store, empty
    planted = {"shard-00000": plant_shard(store, "shard-00000", seed=1)}  # as if left by another capture

    def plant_next(result):  # the next task's folder appears while this run works
        if len(planted) == 1:
            planted["shard-00002"] = plant_shard(store, "shard-00002", seed=2)

    summary = fleet_run(store, target, records, on_result=plant_next)
    assert not summary.ok and [f["shard"] for f in summary.failed] == ["shard-00002"]
    error = summary.failed[0]["error"]
    assert f"shard {shard_dir(store, 'shard-00002')} exists but is not this task's" in error
    assert "0 of the task's 2; left alone, not adopted" in error and summary.failed[0]["attempts"] == 1
    assert any(f"{shard_dir(store, 'shard-00000')} is not listed" in w for w in summary.left_alone)
    listed = [e["name"] for e in read_manifest(store)["shards"]]
    assert "shard-00000" not in listed and "shard-00002" not in listed
    for name, ids in planted.items():  # left as they were
        assert set(json.loads((shard_dir(store, name) / "zarr.json").read_text())["attributes"]["seq_ids"]) == ids
    # the rerun names its shards past every folder on disk and completes the prompts; the planted ones stay out
    again = fleet_run(store, target, records)
    assert again.ok and len(again.left_alone) == 2  # the planted folders are reported again, never adopted
    assert stored_once(store) == sorted(r.seq_id for r in records)


def test_a_failed_commit_leaves_no_temporary_folder(tmp_path):
    writer = StoreWriter(tmp_path / "s", **small())
    shard = writer.shard("shard-00000")
    for s in make_sequences():
        shard.append(**s)
    assert shard.tmp.is_dir()
    taken = shard_dir(tmp_path / "s", "shard-00000")
    taken.mkdir()
    (taken / "theirs").write_text("another writer's file")  # the rename onto it fails (a folder that is not empty)
    with pytest.raises(OSError):
        shard.commit()
    assert leftovers(tmp_path / "s") == [] and (taken / "theirs").read_text() == "another writer's file"


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB tmpfs (needs root: CI runs the tests as root), unmounted after the test."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def fill(path: Path, leave: int = 0) -> Path:
    """Fill the filesystem of `path` with one file, until at most `leave` bytes are free."""
    filler = path / "filler"
    with open(filler, "ab", buffering=0) as f:
        try:
            while (free := shutil.disk_usage(path).free) > leave:
                f.write(b"\1" * min(65536, max(4096, free - leave)))
        except OSError:  # full
            pass
    return filler


def test_a_capture_stops_at_the_first_shard_the_disk_cannot_hold_and_resumes_once_there_is_room(
    tmp_path, tmpfs, target
):
    store, limit = tmpfs / "store", 200
    out = run(pipeline_cmd(target, store, limit, tmp_path / "run1"))
    assert out.returncode == 1, out.stderr[-3000:]
    failed = [line for line in out.stdout.splitlines() if "FAILED" in line]
    assert len(failed) == 2, out.stdout[-3000:]
    assert "after 1 attempt(s): DiskFullError: not enough space for shard " + str(store / SHARDS) in failed[0]
    assert "bytes free there; free space or capture into another directory" in failed[0]
    assert failed[1].startswith("  FAILED: the run stopped: disk full at shard shard-") and "not started)" in failed[1]
    assert leftovers(store) == []
    done = stored_once(store)  # what committed before the disk filled is listed, intact and verifies
    assert 0 < len(done) < len(prompt_ids(limit)) and set(done) <= set(prompt_ids(limit))
    subprocess.run(["mount", "-o", "remount,size=16m", str(tmpfs)], check=True)
    again = run(pipeline_cmd(target, store, limit, tmp_path / "run2"))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert stored_once(store) == prompt_ids(limit) and leftovers(store) == []


@pytest.mark.parametrize("writer_threads", ["auto", 1])  # auto on a CPU: shards written in the decode loop
def test_a_disk_that_fills_under_a_run_is_named_and_leaves_no_temporary_files(tmpfs, target, writer_threads):
    store = tmpfs / "store"
    filled = []

    def fill_disk(result):  # another program takes the disk as the first shard commits
        if not filled:
            filled.append(fill(tmpfs))

    records = load_prompts("humaneval", limit=6)
    summary = fleet_run(store, target, records, on_result=fill_disk, writer_threads=writer_threads)
    lines = "\n".join(summary.lines())
    assert not summary.ok and summary.shards_done == 1
    assert f"FAILED shard shard-00001 after 1 attempt(s): DiskFullError: not enough space for shard {store}" in lines
    assert summary.stopped.startswith("the run stopped: disk full at shard shard-00001")
    assert leftovers(store) == [] and len(stored_once(store)) == 2
    # shard-00001 was opened ahead (its prompts joined the decode) before the disk filled: its temporary folder is
    # deleted before the run writes its record, and the record then fits where that folder was
    last_run = read_manifest(store)["last_run"]
    assert [f["shard"] for f in last_run["failed_shards"]] == ["shard-00001"]
    assert "DiskFullError: not enough space for shard" in last_run["failed_shards"][0]["error"]
    filled[0].unlink()


def test_a_disk_that_fills_as_the_last_shard_commits_names_the_run_record_it_could_not_write(tmpfs, target):
    store = tmpfs / "store"
    filled = []

    def fill_disk(result):  # another program takes the disk as the last shard commits: the run has nothing to free
        if result["info"]["name"] == "shard-00002":
            filled.append(fill(tmpfs))

    summary = fleet_run(store, target, load_prompts("humaneval", limit=6), on_result=fill_disk)
    assert filled and summary.shards_done == 3 and not summary.failed and not summary.ok
    # the run's bookkeeping met the full disk itself: the manifest update is named, its temp file removed
    assert summary.stopped.startswith("the run's last_run not written: DiskFullError: no space left on device")
    assert f"no space left on device writing {store}/" in summary.stopped and " bytes free there" in summary.stopped
    assert "FAILED: the run's last_run not written" in "\n".join(summary.lines())
    assert leftovers(store) == [] and len(stored_once(store)) == 6
    filled[0].unlink()


def test_a_shard_writer_on_a_full_disk_names_the_shard_and_the_free_bytes(tmpfs):
    writer = StoreWriter(tmpfs / "s", **small("float32"))
    fill(tmpfs, leave=64 << 10)
    shard = writer.shard("shard-00000")
    with pytest.raises(DiskFullError) as full:
        for s in make_sequences(lengths=(300,) * 20):
            shard.append(**s)
        shard.commit()
    msg = str(full.value)
    assert msg.startswith(f"no space left on device writing {shard_dir(tmpfs / 's', 'shard-00000')}: ")
    assert " bytes free there (No space left on device)" in msg
    assert leftovers(tmpfs / "s") == []
    fill(tmpfs)
    with pytest.raises(DiskFullError, match=f"no space left on device writing {tmpfs / 's' / MANIFEST}: "):
        writer.update(note="x")
    assert leftovers(tmpfs / "s") == [] and read_manifest(tmpfs / "s")["shards"] == []
