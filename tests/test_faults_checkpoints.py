"""Faults of a run's checkpoints and of its folder (issue #58, failures 2-4): a `latest` naming a missing or broken
step resumes from the newest intact one and says so (never training from step 1 over intact checkpoints, never
pruning them), no intact step is refused by name, one trainer a run (a second refused naming the first, a dead one's
lock taken over), and a resume on stores of another feature basis refused by name.

Each run is a tiny one on a CPU (tests/test_trainer_fixtures.py): a module's run saves steps 2, 3 and 4, and each
test damages a copy of it and trains again, in this process where the test is not about processes (a second trainer,
a killed one, two ranks)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from flashdraft.store import StoreReader, write_store
from flashdraft.store.projection import fit_projection, save_projection
from tests.test_trainer_fixtures import STORE_LAYERS, H, metrics, run_training, tiny_store, tiny_target, train_here
from tests.test_trainer_fixtures import train_kwargs as fixture_kwargs

MODEL_FILE, OPTIM_FILE = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"
ALL_LAYERS = {"num_layers": 2, "block_size": 4}  # a drafter reading every stored layer (a projected store's only way)


def train_kwargs(tmp: Path, store, target, **over) -> dict:
    """A short run: 4 steps of ZeRO 1, a checkpoint every step (the 3 newest kept), nothing held out."""
    common = dict(epochs=1, max_steps=4, checkpoint_every=1, keep_checkpoints=3, eval_every=0, heldout_fraction=0.0)
    return fixture_kwargs(tmp, store, target, **{**common, "zero_stage": 1, **over})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A target, a store and a run that saved steps 2, 3 and 4 (`latest` names step 4)."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    target = tiny_target(tmp / "target")
    store = tiny_store(tmp / "store", target, n=24)
    kw = train_kwargs(tmp / "run", store.path, target)
    train_here(kw)
    assert tags(tmp / "run") == ["step-00000002", "step-00000003", "step-00000004"]
    return tmp / "run", kw, target, store


def copy_run(saved, tmp_path: Path) -> tuple[Path, dict]:
    """A copy of a module's run to damage, and its training config (out_dir and drafter_dir in the copy)."""
    run, kw = saved[:2]
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    return copy, {**kw, "out_dir": str(copy / "run"), "drafter_dir": str(copy / "drafter")}


def root(run: Path) -> Path:
    return run / "run" / "checkpoints"


def tags(run: Path) -> list[str]:
    return sorted(p.name for p in root(run).glob("step-*"))


def train(kw: dict, drafter=None) -> subprocess.CompletedProcess:
    """Train again (in this process) on `kw`, returning how it ended: stdout and stderr together in stdout, as a
    process started with stderr=STDOUT gives them."""
    done = train_here(kw, drafter, check=False)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout + done.stderr, "")


def tree(folder: Path) -> dict:
    """Every file under `folder` with its bytes: what a refused trainer must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- 2. a `latest` naming a missing or broken step -------------------------------------------------------------


def test_latest_naming_a_deleted_step_resumes_from_the_newest_intact_one_and_keeps_it(saved, tmp_path):
    run, kw = copy_run(saved, tmp_path)
    before = metrics(run / "run")
    shutil.rmtree(root(run) / "step-00000004")
    done = train(kw)
    assert done.returncode == 0, done.stdout[-3000:]
    missing = f"{root(run) / 'latest'} names step-00000004, which cannot be resumed: {root(run) / 'step-00000004'} is"
    assert (
        f"{missing} missing; resuming from the newest intact checkpoint, {root(run) / 'step-00000003'}" in done.stdout
    )
    assert f"resumed from {root(run) / 'step-00000003'}: epoch 0, step 3" in done.stdout
    assert tags(run) == ["step-00000002", "step-00000003", "step-00000004"]  # step 4 saved again, 2 and 3 kept
    assert (root(run) / "latest").read_text().strip() == "step-00000004"
    assert metrics(run / "run")[:3] == before[:3] and [m["step"] for m in metrics(run / "run")] == [1, 2, 3, 4]


def test_two_ranks_resume_alike_from_the_newest_intact_step(saved, tmp_path):
    """Rank 0 chooses the step and every rank takes it; rank 0 alone holds the run's lock (the other rank, on the
    same host, is not refused by it)."""
    _, _, target, store = saved
    kw = train_kwargs(tmp_path, store.path, target, epochs=3)
    run_training(tmp_path, kw, nproc=2)
    assert tags(tmp_path) == ["step-00000002", "step-00000003", "step-00000004"]
    shutil.rmtree(root(tmp_path) / "step-00000004")
    done = run_training(tmp_path, kw, nproc=2)
    assert f"resuming from the newest intact checkpoint, {root(tmp_path) / 'step-00000003'}" in done.stdout
    assert f"resumed from {root(tmp_path) / 'step-00000003'}" in done.stdout
    assert tags(tmp_path) == ["step-00000002", "step-00000003", "step-00000004"]
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def empty(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.mkdir()


DAMAGES = {  # what is done to step 4, and the file the message must name with what it says of it
    "empty folder": (lambda step: empty(step), "", "is empty"),
    "truncated model file": (lambda step: truncate(step / MODEL_FILE), MODEL_FILE, "is not a whole torch file"),
    "flipped optimizer bytes": (lambda step: flip_middle(step / OPTIM_FILE), OPTIM_FILE, "is damaged: its part"),
    "unreadable client state": (
        lambda step: (step / "client_state.json").write_text('{"global_step": 4, "dty'),
        "client_state.json",
        "is unreadable",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_broken_step_named_by_latest_falls_back_to_the_newest_intact_one_naming_the_path(saved, tmp_path, damage):
    run, kw = copy_run(saved, tmp_path)
    spoil, name, says = DAMAGES[damage]
    step4 = root(run) / "step-00000004"
    spoil(step4)
    done = train(kw)
    assert done.returncode == 0, done.stdout[-3000:]
    bad = step4 / name if name else step4
    assert f"names step-00000004, which cannot be resumed: {bad} {says}" in done.stdout, done.stdout[-3000:]
    assert f"resuming from the newest intact checkpoint, {root(run) / 'step-00000003'}" in done.stdout
    assert f"resumed from {root(run) / 'step-00000003'}: epoch 0, step 3" in done.stdout
    # step 4 saved again in its own folder, the broken one gone with it; the intact steps kept
    assert tags(run) == ["step-00000002", "step-00000003", "step-00000004-1"]
    assert (root(run) / "latest").read_text().strip() == "step-00000004-1"
    assert [m["step"] for m in metrics(run / "run")] == [1, 2, 3, 4]


def test_no_intact_step_is_refused_naming_each_and_nothing_is_touched(saved, tmp_path):
    run, kw = copy_run(saved, tmp_path)
    empty(root(run) / "step-00000004")
    truncate(root(run) / "step-00000003" / OPTIM_FILE)
    (root(run) / "step-00000002" / "client_state.json").unlink()
    before = tree(Path(kw["out_dir"]))
    done = train(kw)
    assert done.returncode != 0
    out = done.stdout
    assert f"no checkpoint in {root(run)} can be resumed: {root(run) / 'step-00000004'} is empty; " in out, out[-3000:]
    assert f"{root(run) / 'step-00000003' / OPTIM_FILE} is not a whole torch file" in out
    assert f"{root(run) / 'step-00000002' / 'client_state.json'} is missing" in out
    assert "Refused rather than training from step 1 over them" in out
    assert f"move {root(run)} aside or train into another train.out_dir" in out
    assert tree(Path(kw["out_dir"])) == before  # nothing trained, pruned or rewritten


# --- 3. one trainer a run --------------------------------------------------------------------------------------


def wait_for_lock(lock: Path, proc: subprocess.Popen, timeout=240) -> dict:
    """The lock record once process `proc` holds the run's lock (fails if it ends without taking one)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            record = json.loads(lock.read_text() or "{}")
        except (OSError, ValueError):
            record = {}
        if record.get("pid") == proc.pid:
            return record
        assert proc.poll() is None, f"the trainer ended without holding {lock}: " + proc.communicate()[0][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"trainer {proc.pid} never took {lock}")


def test_a_second_trainer_on_one_out_dir_is_refused_by_name_and_the_first_completes_untouched(saved, tmp_path):
    _, _, target, store = saved
    first_dir = tmp_path / "first"
    kw = train_kwargs(first_dir, store.path, target, checkpoint_every=2)
    lock = Path(kw["out_dir"]) / "trainer.lock"
    first = run_training(first_dir, kw, wait=False)
    try:
        holder = wait_for_lock(lock, first)
        os.kill(first.pid, signal.SIGSTOP)  # the first holds the lock mid-run, whatever the machine's speed
        before = tree(Path(kw["out_dir"]))
        second = train(kw)  # in this process: another than the first
        assert tree(Path(kw["out_dir"])) == before, "the refused trainer changed the run's folder"
    finally:
        if first.returncode is None:
            os.kill(first.pid, signal.SIGCONT)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:]
    assert second.returncode != 0
    assert (
        f"TrainerLockedError: {kw['out_dir']} is in use by another trainer (host {socket.gethostname()}, "
        f"pid {first.pid}, started {holder['started']}; lock {lock}). One trainer runs in a train.out_dir at a time"
    ) in second.stdout, second.stdout[-3000:]
    assert "resumed from" not in out and "removed" not in out
    assert [m["step"] for m in metrics(Path(kw["out_dir"]))] == [1, 2, 3, 4]
    assert tags(first_dir) == ["step-00000002", "step-00000004"]
    assert lock.read_text() == ""  # a clean end leaves no holder behind


def test_the_lock_of_a_killed_trainer_is_taken_over_and_said(saved, tmp_path):
    run, kw = copy_run(saved, tmp_path)
    lock = Path(kw["out_dir"]) / "trainer.lock"
    dead = run_training(run, kw, wait=False)
    holder = wait_for_lock(lock, dead)
    dead.kill()
    dead.communicate(timeout=60)
    proc = train_here(kw)  # resumes at step 4, the last: nothing left to train
    took = (
        f"took over the lock {lock} of an earlier trainer (host {socket.gethostname()}, pid {dead.pid}, "
        f"started {holder['started']}; no longer running)"
    )
    assert took in proc.stderr, proc.stderr[-3000:]
    assert f"resumed from {root(run) / 'step-00000004'}" in proc.stdout
    assert tags(run) == ["step-00000002", "step-00000003", "step-00000004"] and lock.read_text() == ""


# --- 4. a resume on stores of another feature basis -------------------------------------------------------------


def projected_store(path: Path, raw: StoreReader, calibration_rows: int | None = None) -> tuple[Path, str]:
    """A copy of `raw` projected to H dims by a basis fit on its first `calibration_rows` tokens (all: None), as a
    capture or transcode writes one; returns its path and the basis's sha256."""
    seqs = [raw.read(i) for i in range(len(raw))]
    proj = fit_projection(torch.cat([s.features for s in seqs])[:calibration_rows], H)
    entry = save_projection(path, proj, layer_ids=STORE_LAYERS, hidden_size=H)
    manifest = {k: raw.manifest[k] for k in ("target", "vocab_size")} | {"projection": entry}
    rows = [
        {
            "seq_id": s.seq_id,
            "input_ids": s.input_ids,
            "loss_mask": s.loss_mask,
            "features": s.features @ proj.projection,
        }
        for s in seqs
    ]
    write_store(
        path, rows, layer_ids=STORE_LAYERS, hidden_size=H, dtype="float32", manifest_extra=manifest, project_dims=H
    )
    return path, entry["sha256"]


@pytest.fixture(scope="module")
def projected(saved, tmp_path_factory):
    """A run that saved steps 1 and 2 on a projected store (basis A), and the raw store it was projected from."""
    _, _, target, raw = saved
    tmp = tmp_path_factory.mktemp("projected")
    store, sha = projected_store(tmp / "features", raw)
    kw = train_kwargs(tmp / "run", store, target, max_steps=2)
    train_here(kw, drafter=ALL_LAYERS)
    return tmp / "run", kw, sha, raw


def test_a_resume_on_a_store_recreated_with_another_basis_is_refused_by_name(projected, tmp_path):
    _, _, sha_a, raw = projected
    run, kw = copy_run(projected, tmp_path)
    store, sha_b = projected_store(tmp_path / "features", raw, calibration_rows=200)  # the same data, basis B
    assert sha_b != sha_a
    done = train({**kw, "stores": [str(store)]}, drafter=ALL_LAYERS)
    assert done.returncode != 0 and "resumed from" not in done.stdout
    assert (
        f"train.stores {[str(store)]} hold features projected by the basis sha256 {sha_b[:12]}, but the checkpoint "
        f"{root(run) / 'step-00000002'} was trained on features projected by the basis sha256 {sha_a[:12]}: resuming "
        "it would fold an fc' trained on one basis with the other; refused. Train into a new train.out_dir, or point "
        "train.stores back at the store(s) of"
    ) in done.stdout, done.stdout[-3000:]


def test_a_projected_checkpoint_resumed_on_a_raw_store_is_refused_by_name(projected, tmp_path):
    _, _, sha_a, raw = projected
    run, kw = copy_run(projected, tmp_path)
    done = train({**kw, "stores": [str(raw.path)]}, drafter=ALL_LAYERS)
    assert done.returncode != 0 and "size mismatch" not in done.stdout
    assert (
        f"train.stores {[str(raw.path)]} hold raw features, but the checkpoint {root(run) / 'step-00000002'} was "
        f"trained on features projected by the basis sha256 {sha_a[:12]}: resuming it would not fit fc's shape; "
        "refused. Train into a new train.out_dir"
    ) in done.stdout, done.stdout[-3000:]
