"""Durable on power loss, immune to stale machine state: a local capture that starts its own Ray whatever the machine
remembers, renames that commit data followed by an fsync of their folder, checkpoints and exports that a crash at
any step leaves loadable, a store whose listed shard is gone repaired, bad settings and manifests refused by name."""

import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from flashdraft.model import DFlashDrafter
from flashdraft.prompts import load_prompts
from flashdraft.spec import DraftSpec
from flashdraft.store import StoreError, StoreReader, read_manifest, verify_store, write_store
from flashdraft.store.files import MANIFEST, shard_dir, shard_seq_ids
from pipeline.fleet import FleetConfig, run_fleet
from pipeline.job import load_records, open_store
from tests.test_faults_writer import command_here, env, pipeline_cmd, prompt_ids, run, stored_once
from tests.test_pipeline import build_tiny_target, settings_for
from tests.test_store import make_sequences, small
from tests.test_trainer_fixtures import as_a_process
from trainer import checkpoint as ck
from trainer.engine import build_engine, init_distributed, setup_distributed_env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


# --- 1. a local capture starts its own Ray ---------------------------------------------------------------------


def closed_port() -> int:
    """A loopback port nothing listens on (the address of a cluster long gone)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_tmpdir():
    """Ray's temp folder for one test (RAY_TMPDIR), short: Ray's socket paths must fit 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("remembered", ["ray_current_cluster", "RAY_ADDRESS"])
def test_a_stale_cluster_the_machine_remembers_does_not_stop_a_local_capture(tmp_path, target, ray_tmpdir, remembered):
    stale = f"127.0.0.1:{closed_port()}"
    extra = {"RAY_TMPDIR": str(ray_tmpdir)}
    if remembered == "RAY_ADDRESS":
        extra["RAY_ADDRESS"] = stale
    else:  # what `ray start` leaves in Ray's temp folder, long after its cluster is gone
        (ray_tmpdir / "ray").mkdir()
        (ray_tmpdir / "ray" / "ray_current_cluster").write_text(stale)
    store = tmp_path / "store"
    cmd = [*pipeline_cmd(target, store, 2, tmp_path / "run"), "cluster.num_actors=1", "cluster.cpus_per_actor=1"]
    proc = subprocess.run(cmd, cwd=REPO, env={**env(), **extra}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Ray: a local instance on 127.0.0.1, started for this run" in proc.stdout
    assert f"not joining {'RAY_ADDRESS=' if remembered == 'RAY_ADDRESS' else ''}{stale}" in proc.stdout
    assert stored_once(store) == prompt_ids(2)


# --- 2. directory fsyncs after each rename that commits store data ------------------------------------------


def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def fs_events(monkeypatch):
    """Every rename and fsync of this process, in order: ("rename", src, dst) and ("fsync", path)."""
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("fsync", fd_path(fd.fileno() if hasattr(fd, "fileno") else fd)))
        return real_fsync(fd)

    def rename(src, dst, **kw):
        real_rename(src, dst, **kw)
        events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))

    def replace(src, dst, **kw):
        real_replace(src, dst, **kw)
        events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return events


def commits_without_a_folder_fsync(events, is_commit) -> tuple[list[str], list[str]]:
    """(the commit renames seen, those not followed by an fsync of their destination's folder before the next
    commit rename or the end)."""
    renames = [i for i, e in enumerate(events) if e[0] == "rename" and is_commit(e[2])]
    seen, bad = [], []
    for n, i in enumerate(renames):
        dst = events[i][2]
        seen.append(os.path.basename(dst))
        end = renames[n + 1] if n + 1 < len(renames) else len(events)
        if ("fsync", os.path.dirname(dst)) not in events[i + 1 : end]:
            bad.append(f"rename to {dst} (event {i}) with no fsync of {os.path.dirname(dst)} after it")
    return seen, bad


def test_every_rename_that_commits_store_data_is_followed_by_an_fsync_of_its_folder(tmp_path, target, fs_events):
    store = tmp_path / "store"
    settings = settings_for(target, torch_threads=1)
    writer = open_store(store, settings, sources=["test"], store_options=dict(shard_tokens=256, chunk_tokens=32))
    records = load_prompts("humaneval", limit=4)
    summary = run_fleet(store, records, settings, writer, FleetConfig(num_actors=0, shard_size=2), progress=False)
    assert summary.ok and summary.sequences == 4

    def is_commit(dst: str) -> bool:  # not a file moved inside a shard still being written
        return ".tmp-" not in dst

    seen, bad = commits_without_a_folder_fsync(fs_events, is_commit)
    assert {"shard-00000", "shard-00001", "manifest.json", "rejects.jsonl"} <= set(seen), seen
    assert not bad, "\n".join(bad)
    # and each shard's own files and folders were fsynced before its rename
    for name in ("shard-00000", "shard-00001"):
        i = next(k for k, e in enumerate(fs_events) if e[0] == "rename" and e[2] == str(shard_dir(store, name)))
        tmp = fs_events[i][1]
        synced = {e[1] for e in fs_events[:i] if e[0] == "fsync"}
        files = {str(p).replace(str(shard_dir(store, name)), tmp) for p in shard_dir(store, name).rglob("*")}
        assert files | {tmp} <= synced, sorted(files | {tmp} - synced)


# --- 3. checkpoints and exports: fsynced, and a crash at any step leaves a loadable one ---------------------------


class Crash(BaseException):
    """Raised at the k-th filesystem call of a save: the process stops there (nothing after it runs, nothing before
    it is undone)."""


class Steps:
    """The filesystem calls of a save or an export, counted; `crash_at` k raises Crash at the k-th."""

    names = [(os, "replace"), (os, "rename"), (os, "fsync"), (os, "unlink"), (shutil, "rmtree")]

    def __init__(self, crash_at=None):
        self.crash_at, self.count, self.fsynced, self.real = crash_at, 0, [], {}

    def __enter__(self):
        for mod, name in self.names:
            real = getattr(mod, name)
            self.real[(mod, name)] = real
            setattr(mod, name, self.wrap(name, real))
        return self

    def wrap(self, name, real):
        def step(*a, **kw):
            if self.count == self.crash_at:
                raise Crash(name)
            self.count += 1
            if name == "fsync":
                self.fsynced.append(os.readlink(f"/proc/self/fd/{a[0]}"))
            return real(*a, **kw)

        return step

    def __exit__(self, *exc):
        for (mod, name), real in self.real.items():
            setattr(mod, name, real)
        return exc[0] is Crash


class Saves:
    """A one-layer drafter's DeepSpeed engine (ZeRO 0) in this process, and what its saves and exports leave."""

    def __init__(self):
        setup_distributed_env()
        init_distributed(torch.device("cpu"))
        target = Qwen3Config(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=64,
        )
        self.config = DraftSpec((1, 2), mask_token_id=96, block_size=4, num_draft_layers=1).draft_config(target)
        model = DFlashDrafter(self.config)
        optim = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), warmup_steps=1, total_steps=10)
        self.engine, _ = build_engine(model, **optim, zero_stage=0, grad_accum=1, grad_clip=1.0, bf16=False)

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}

    def set_weights(self, w) -> None:
        with torch.no_grad():
            self.engine.module.load_state_dict(w)

    def export(self, path, weights=None) -> None:
        ck.export_drafter(DFlashDrafter, self.config, self.weights() if weights is None else weights, path)

    def save(self, root, step, crash_at=None) -> tuple[Path | None, Steps]:
        """(the step's folder (None: crashed), the filesystem calls the save made)."""
        with Steps(crash_at) as steps:
            final = ck.save_checkpoint(self.engine, root, step, {"global_step": step}, export=self.export)
        return (final if crash_at is None else None), steps

    def loadable(self, root, allowed) -> str | None:
        """None if the checkpoint `latest` names loads and holds one of the `allowed` weights, else what is wrong."""
        try:
            tag = ck.latest_tag(root)
            if tag is None:
                return "no checkpoint: latest names nothing that exists"
            ck.load_checkpoint(self.engine, root, tag)
            drafter = DFlashDrafter.from_pretrained(root / tag / "drafter")
        except Exception as e:
            return f"the checkpoint latest names does not load: {type(e).__name__}: {e}"[:300]
        got = self.weights()
        if not any(same(got, w) for w in allowed):
            return f"{tag} holds weights that are neither the previous nor the new ones"
        if not same(got, drafter.state_dict()):
            return f"{tag}/drafter does not hold the checkpoint's weights"
        return None


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def save_fsyncs(saves: Saves, base: Path, out: Path, w_b) -> list[str]:
    """What a save does not fsync of what it should: every file of the checkpoint, its folder's name in the root,
    latest and its folder."""
    fs = out / "fsync"
    shutil.copytree(base, fs)
    saves.set_weights(w_b)
    final, steps = saves.save(fs, 2)
    tmp = fs / ".tmp-step-00000002" / "step-00000002"
    files = {str(p).replace(str(final), str(tmp)) for p in final.rglob("*") if p.is_file()}
    missing = sorted(files - set(steps.fsynced))
    root_syncs = [k for k, p in enumerate(steps.fsynced) if p == str(fs)]
    latest_synced = any(p.startswith(str(fs / "latest")) for p in steps.fsynced)
    problems = [f"not fsynced: {missing}"] if missing else []
    if len(root_syncs) < 2:
        problems.append(
            f"the checkpoint root was fsynced {len(root_syncs)} time(s), not after both the checkpoint rename and the "
            "latest replace"
        )
    return problems + ([] if latest_synced else ["latest was not fsynced before its rename"])


def save_crashes(saves: Saves, base: Path, out: Path, scenario: str, step: int, w_a, w_b) -> dict:
    """A crash at every step of a save (of a new step, or of a step whose folder latest names already)."""
    shutil.copytree(base, out / f"count-{scenario}")  # the same save as below, uninterrupted: its steps
    saves.set_weights(w_b)
    _, count = saves.save(out / f"count-{scenario}", step)
    problems = []
    for k in range(count.count + 1):  # k == count: no crash, the save completes
        root = out / f"{scenario}-{k}"
        shutil.copytree(base, root)
        saves.set_weights(w_b)
        saves.save(root, step, crash_at=k)
        why = saves.loadable(root, [w_a, w_b] if k < count.count else [w_b])
        if why:
            problems.append(f"crash at step {k} of {count.count}: {why}")
        shutil.rmtree(root)
    return {"steps": count.count, "problems": problems}


def export_crashes(saves: Saves, out: Path, w_a, w_b) -> dict:
    """A crash at every step of an export over a previous drafter."""
    drafter_dir = out / "drafter"
    saves.export(drafter_dir, w_a)
    shutil.copytree(drafter_dir, out / "count-export")
    with Steps() as count:
        saves.export(out / "count-export", w_b)
    problems = []
    for k in range(count.count + 1):
        d = out / f"export-{k}" / "drafter"
        shutil.copytree(drafter_dir, d)
        with Steps(crash_at=k):
            saves.export(d, w_b)
        try:
            got = DFlashDrafter.from_pretrained(d).state_dict()
        except Exception as e:
            problems.append(f"crash at step {k} of {count.count}: no loadable drafter at {d}: {e}"[:300])
            continue
        if not (same(got, w_b) or (k < count.count and same(got, w_a))):
            problems.append(f"crash at step {k} of {count.count}: the drafter at {d} is neither the old nor the new")
    return {"steps": count.count, "problems": problems}


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    """Per scenario the steps a save or an export has and the problems a crash at each one left (in this process:
    a crash is a raise at the filesystem call, the process needs not end)."""
    out = tmp_path_factory.mktemp("ckpt-crash")
    with as_a_process():
        saves = Saves()
        w_a = saves.weights()
        base = out / "base"
        saves.save(base, 1)
        w_b = {k: v + 1 for k, v in w_a.items()}
        results = {"fsync": save_fsyncs(saves, base, out, w_b)}
        for scenario, step in (("save-new-step", 2), ("save-same-step", 1)):
            results[scenario] = save_crashes(saves, base, out, scenario, step, w_a, w_b)
        results["export"] = export_crashes(saves, out, w_a, w_b)
    return results


def test_a_checkpoint_save_fsyncs_its_files_its_folder_and_latest(crashes):
    assert crashes["fsync"] == []


@pytest.mark.parametrize("scenario", ["save-new-step", "save-same-step", "export"])
def test_a_crash_at_every_step_of_a_save_or_export_leaves_a_loadable_previous_or_new_one(crashes, scenario):
    found = crashes[scenario]
    assert found["steps"] >= 3, found  # the simulation did reach the steps it is about
    assert found["problems"] == [], "\n".join(found["problems"])


@pytest.mark.parametrize("tag", ["../../..", "/etc", "step-00000002/../../..", "steps", ""])
def test_a_latest_that_names_no_checkpoint_is_refused(tmp_path, tag):
    from trainer.checkpoint import latest_tag

    root = tmp_path / "run" / "checkpoints"
    (root / "step-00000002").mkdir(parents=True)
    (root / "latest").write_text(tag + "\n")
    with pytest.raises(ValueError, match=r"latest names .* not a checkpoint of the form step-NNNNNNNN; refused"):
        latest_tag(root)
    (root / "latest").write_text("step-00000002\n")
    assert latest_tag(root) == "step-00000002"


# --- 4. a listed shard missing on disk: named with its repair, which recaptures exactly its prompts ---------------


def test_a_listed_shard_missing_on_disk_is_repaired_and_exactly_its_prompts_recaptured(captured_copy):
    _, store, capture = captured_copy  # 6 prompts, 2 a shard
    limit = 6
    names = [e["name"] for e in read_manifest(store)["shards"]]
    assert len(names) == 3
    lost = shard_seq_ids(shard_dir(store, names[1]))
    shutil.rmtree(shard_dir(store, names[1]))  # a shard whose rename a power loss undid

    rerun = run(capture)
    assert rerun.returncode == 1
    assert (
        f"shard {names[1]} is listed in {store / MANIFEST} but {shard_dir(store, names[1])} is missing" in rerun.stderr
    )
    assert f"python -m pipeline repair {store}" in rerun.stderr
    checked = command_here("verify", store)
    assert checked.returncode == 1 and "python -m pipeline repair" in checked.stderr

    repaired = command_here("repair", store)
    assert repaired.returncode == 0, repaired.stderr
    assert f"dropped {names[1]} ({len(lost)} sequences" in repaired.stdout
    assert [e["name"] for e in read_manifest(store)["shards"]] == [names[0], names[2]]
    assert verify_store(store, progress=False)[0] == []

    again = run(capture)
    assert again.returncode == 0, again.stderr[-3000:]
    new = [e["name"] for e in read_manifest(store)["shards"]]
    assert new[:2] == [names[0], names[2]] and len(new) == 3
    assert shard_seq_ids(shard_dir(store, new[2])) == lost  # exactly the lost shard's prompts, captured again
    assert stored_once(store) == prompt_ids(limit)
    assert "1 shard entry dropped" in repaired.stdout
    nothing = command_here("repair", store)
    assert nothing.returncode == 0 and "nothing to repair" in nothing.stdout


# --- 5. bad values refused by name -------------------------------------------------------------------------------


def test_a_data_limit_that_is_not_a_count_is_refused_by_name(tmp_path, target):
    proc = run(pipeline_cmd(target, tmp_path / "store", "abc", tmp_path / "run"))
    assert proc.returncode == 1
    assert "error: data.limit must be a number of records (0 or more) or null, got 'abc'" in proc.stderr
    assert "Traceback" not in proc.stderr and "TypeError" not in proc.stderr
    assert not (tmp_path / "store" / MANIFEST).exists()
    for limit, key in (({"humaneval": "x"}, "data.limit.humaneval"), (-1, "data.limit"), (True, "data.limit")):
        with pytest.raises(ValueError, match=rf"^{key} must be a number of records"):
            load_records(["humaneval"], split="train", limit=limit)
    with pytest.raises(ValueError, match=r"^limit must be a number of records"):
        load_prompts("humaneval", limit=2.5)


@pytest.mark.parametrize("field, value", [("sequences", None), ("tokens", None), ("sequences", "x"), ("tokens", -1)])
def test_a_manifest_entry_missing_a_count_is_refused_by_name(tmp_path, field, value):
    store = tmp_path / "s"
    write_store(store, make_sequences(), **small())
    manifest = json.loads((store / MANIFEST).read_text())
    if value is None:
        del manifest["shards"][0][field]
        said = f"has no {field!r}"
    else:
        manifest["shards"][0][field] = value
        said = f"has {field} {value!r}, not a count"
    (store / MANIFEST).write_text(json.dumps(manifest))
    message = f"{store / MANIFEST} is corrupt: the entry of shard shard-00000 {said}; refused"
    for open_it in (read_manifest, StoreReader):
        with pytest.raises(StoreError) as refused:
            open_it(store)
        assert str(refused.value) == message
    problems, _ = verify_store(store, progress=False)
    assert problems == [message]
