"""Corrupt stores as a user meets them: bytes flipped inside an inner chunk and a truncated data file, in every
array kind of a store (ids, loss mask, features, fp8 scales, teacher top-k). `python -m pipeline verify`, the
reader, the trainer before step 1 and the harness each refuse them, naming store, shard, array and rows; and a
trainer SIGKILLed while it saves a checkpoint resumes to the losses of an uninterrupted run."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flashdraft.store import StoreError, StoreLayout, StoreReader, StoreWriter, read_manifest, shard_name
from flashdraft.store.files import array_file, read_shard_attrs, shard_dir
from flashdraft.store.format import decode_index, index_nbytes
from tests.test_trainer_fixtures import metrics, run_training, tiny_store, tiny_target, train_here, train_kwargs
from trainer.store_verify import CorruptStore, verify_stores

REPO = Path(__file__).resolve().parents[1]
H, LAYERS, TOPK, CHUNK = 32, [1, 3], 4, 16
SHARD_LENGTHS = [[40, 30, 26], [20, 50]]  # shard-00000's first sequence alone covers rows 16..32 (inner chunk 1)
LAYOUT = StoreLayout(tuple(LAYERS), H, "float8_e4m3", chunk_tokens=CHUNK, shard_tokens=64, teacher_topk=TOPK)
KEYS = LAYOUT.array_keys()  # every array kind of an fp8 store with a teacher top-k


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    """An fp8 store with a teacher top-k in two shards."""
    path = tmp_path_factory.mktemp("faults") / "store"
    writer = StoreWriter(
        path, layer_ids=LAYERS, hidden_size=H, dtype="float8_e4m3", chunk_tokens=CHUNK, shard_tokens=64,
        teacher_topk=TOPK,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for k, lengths in enumerate(SHARD_LENGTHS):
        with writer.shard(shard_name(k)) as shard:
            for j, n in enumerate(lengths):
                teacher = (rng.integers(0, 100, (n, TOPK)), np.log(np.full((n, TOPK), 0.2)))
                feats = torch.randn(n, len(LAYERS) * H)
                shard.append(f"s{k}-{j}", rng.integers(0, 100, n), np.arange(n) > 3, feats, teacher)
        writer.register(shard.info())
    return path


def data_file(store: Path, key: str, shard: int = 0) -> Path:
    return array_file(shard_dir(store, shard_name(shard)), key, 1 + len(LAYOUT.array_specs()[key][1]))


def flip_inner_chunk(store: Path, key: str, chunk: int = 1) -> None:
    """Flip 8 bytes in the middle of inner chunk `chunk` of shard-00000's array `key` (the index stays intact)."""
    file = data_file(store, key)
    ct = read_manifest(store)["layout"]["chunk_tokens"]
    n = -(-read_shard_attrs(shard_dir(store, shard_name(0)))["offsets"][-1] // ct)
    offset, nbytes = decode_index(file.read_bytes()[-index_nbytes(n) :], n)[chunk].astype(int)
    with open(file, "r+b") as f:
        f.seek(offset + nbytes // 2 - 4)
        data = f.read(8)
        f.seek(offset + nbytes // 2 - 4)
        f.write(bytes(b ^ 0x5A for b in data))


def truncate(store: Path, key: str) -> None:
    """Cut shard-00000's data file of array `key` to half its size (its index at the end is lost)."""
    file = data_file(store, key)
    os.truncate(file, file.stat().st_size // 2)


DAMAGE = {"flip": flip_inner_chunk, "truncate": truncate}
# what `verify` says of each damage in shard-00000's array `key`
SAYS = {
    "flip": lambda key, ct=CHUNK: f"shard shard-00000: array {key}: chunk 1 (rows {ct}..{2 * ct}) is unreadable",
    "truncate": lambda key, ct=CHUNK: f"shard shard-00000: array {key}: data file shards/shard-00000/{key}/",
}


def damaged(sound: Path, tmp_path: Path, fault: str, keys) -> Path:
    store = tmp_path / f"{fault}-store"
    shutil.copytree(sound, store)
    for key in keys:
        DAMAGE[fault](store, key)
    return store


def pipeline_verify(store: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "verify", str(store)], cwd=REPO, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize("fault", ["flip", "truncate"])
def test_pipeline_verify_exits_1_naming_shard_array_and_rows_of_every_array_kind(sound, tmp_path, fault):
    from pipeline.__main__ import verify_command

    assert verify_command([str(sound)]) == 0  # the command in this process; a process says exit 0 in test_faults_repair
    store = damaged(sound, tmp_path, fault, KEYS)  # every array of shard-00000 damaged at once: one run lists all
    out = pipeline_verify(store)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"\n{store}: {len(KEYS)} problem(s)\n" in out.stderr, out.stderr
    for key in KEYS:
        assert SAYS[fault](key) in out.stderr, (key, out.stderr)
    if fault == "truncate":
        assert out.stderr.count("shard index checksum mismatch): rows 0..96 unreadable") == len(KEYS)
    assert "shard-00001" not in out.stderr


@pytest.mark.parametrize("fault", ["flip", "truncate"])
@pytest.mark.parametrize("key", KEYS)
def test_a_read_of_a_damaged_sequence_names_store_shard_array_rows_and_sequence(sound, tmp_path, fault, key):
    store = damaged(sound, tmp_path, fault, [key])
    reader = StoreReader(store)
    teacher = key.startswith("teacher")
    where = rf"{re.escape(str(store))}: shard shard-00000, array {key}, rows 0..40 \(sequence s0-0\) is unreadable: "
    with pytest.raises(StoreError, match=where):
        reader.read(0, teacher=teacher)
    for i in range(len(reader)):  # flip: only chunk 1 (sequence s0-0); truncate: all of shard-00000's array
        hit = reader.seq_ids[i] == "s0-0" or (fault == "truncate" and reader.seq_ids[i].startswith("s0-"))
        if not hit:
            assert reader.read(i, teacher=teacher).seq_id == reader.seq_ids[i]


@pytest.mark.parametrize("fault", ["flip", "truncate"])
def test_verify_stores_full_split_over_ranks_finds_each_problem_once(sound, tmp_path, fault):
    store = damaged(sound, tmp_path, fault, ["features"])
    clean = verify_stores([sound], "full", fraction=0.01)
    assert clean["shards"] == 2 and clean["tokens"] == sum(map(sum, SHARD_LENGTHS))
    with pytest.raises(CorruptStore, match=re.escape(f"{store}: {SAYS[fault]('features')}")):
        verify_stores([store], "full", fraction=0.01)
    # two ranks (no process group: each its part): rank 0 checks shard-00000 and finds it, rank 1 finds nothing
    with pytest.raises(CorruptStore, match="shard-00000: array features"):
        verify_stores([store], "full", fraction=0.01, rank=0, world=2)
    assert verify_stores([store], "full", fraction=0.01, rank=1, world=2)["shards"] == 1


def test_verify_stores_sample_reads_every_index_and_a_share_of_chunks(sound, tmp_path, capsys):
    checked = verify_stores([sound, sound], "sample", fraction=0.5)
    chunks = sum(-(-sum(lengths) // CHUNK) for lengths in SHARD_LENGTHS) * len(KEYS)
    assert checked["indexes"] == 2 * len(KEYS) and checked["chunks_total"] == chunks
    assert checked["chunks"] == sum(round(0.5 * -(-sum(x) // CHUNK)) for x in SHARD_LENGTHS) * len(KEYS)
    assert (
        f"train.verify_store=sample: 2 shards' attributes and {2 * len(KEYS)} shard indexes of 1 store(s)"
        in capsys.readouterr().out
    )
    store = damaged(sound, tmp_path, "truncate", ["teacher_logp"])  # truncation: the index, which sample reads
    with pytest.raises(CorruptStore, match="shard-00000: array teacher_logp: data file .* rows 0..96 unreadable"):
        verify_stores([store], "sample", fraction=0.01)
    store = damaged(sound, tmp_path, "flip", ["loss_mask"])  # a flip: found when the sample takes its chunk
    with pytest.raises(CorruptStore, match=re.escape("array loss_mask: chunk 1 (rows 16..32) is unreadable")):
        verify_stores([store], "sample", fraction=1.0)
    assert verify_stores([store], "off", fraction=1.0) == {}


def test_the_harness_refuses_a_store_with_a_corrupt_input_ids_chunk(sound, tmp_path):
    from harness.datastore import Datastore

    assert len(Datastore.from_store(sound, ngram=2, min_count=1)) > 0
    store = damaged(sound, tmp_path, "flip", ["input_ids"])
    with pytest.raises(StoreError, match=rf"{re.escape(str(store))}: shard shard-00000, array input_ids, rows 0..96"):
        Datastore.from_store(store, ngram=2, min_count=1)


# --- the trainer: in this process, in two (torchrun) and killed in one ---------------------------------------------


@pytest.fixture(scope="module")
def trainer_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer-faults")
    target = tiny_target(tmp / "target")
    store = tiny_store(tmp / "store", target, n=24)
    return tmp, target, store.path


def refused(tmp: Path, kwargs: dict, nproc: int = 1) -> str:
    if nproc == 1:
        done = train_here(kwargs, check=False)
        assert done.returncode != 0
        out = done.stdout + done.stderr
    else:
        with pytest.raises(AssertionError) as failed:
            run_training(tmp, kwargs, nproc=nproc)
        out = str(failed.value)
    assert not (tmp / "run" / "metrics.jsonl").exists() or not metrics(tmp / "run"), "a step was trained"
    return out


@pytest.mark.parametrize("mode, fault, nproc", [("full", "flip", 1), ("full", "flip", 2), ("sample", "truncate", 1)])
def test_the_trainer_refuses_a_corrupt_store_before_step_1(trainer_setup, tmp_path, mode, fault, nproc):
    _, target, sound_store = trainer_setup
    store = tmp_path / "store"
    shutil.copytree(sound_store, store)
    DAMAGE[fault](store, "features")
    kw = train_kwargs(tmp_path, store, target, verify_store=mode, epochs=1, max_steps=2)
    out = refused(tmp_path, kw, nproc)
    assert f"CorruptStore: train.verify_store={mode} found 1 problem(s) in the feature stores" in out, out[-3000:]
    assert f"{store}: {SAYS[fault]('features', read_manifest(store)['layout']['chunk_tokens'])}" in out


def test_sigkill_during_a_checkpoint_save_then_resume_repeats_the_uninterrupted_run(trainer_setup, tmp_path):
    _, target, store = trainer_setup
    common = dict(epochs=2, checkpoint_every=1, eval_every=0, zero_stage=1, verify_store="off")
    ref = tmp_path / "ref"
    train_here(train_kwargs(ref, store, target, **common))
    full = metrics(ref / "run")

    crash = tmp_path / "crash"
    kw = train_kwargs(crash, store, target, **common)
    proc = run_training(crash, kw, wait=False)  # a process: it is killed
    ckpts = crash / "run" / "checkpoints"
    deadline, saving = time.time() + 180, None
    while time.time() < deadline and proc.poll() is None and saving is None:  # the first save after step 2's
        saving = next((p for p in ckpts.glob(".tmp-step-*") if p.name > ".tmp-step-00000002"), None)
    if saving is not None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before a save could be caught"
    assert saving.exists() and not (ckpts / saving.name.removeprefix(".tmp-")).exists()  # killed mid-save
    out = train_here(kw)
    assert "resumed from" in out.stdout
    resumed = metrics(crash / "run")
    assert [m["step"] for m in resumed] == [m["step"] for m in full]
    np.testing.assert_allclose([m["loss"] for m in resumed], [m["loss"] for m in full], rtol=1e-6)
    assert not list(ckpts.glob(".tmp-step-*"))  # the killed save's leftovers are gone
