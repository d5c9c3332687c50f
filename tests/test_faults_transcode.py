"""Faults of `python -m pipeline transcode`, met as a user meets them (issue #58, failures 1, 8 and 9's transcode
part): a transcode SIGKILLed once its first shard is listed (`pipeline verify` and the trainer refuse the partial
copy by name, the same command finishes it into the copy an uninterrupted run writes), two transcodes into one
store, a copy begun from another source or with other options, a bad chunk in the source, a full disk while the
basis is saved (transcode and capture), and options that are not what they should be. Real processes where the
test is about one (killed, held, or the command's exit), the commands' functions in this process elsewhere; a real
tmpfs."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flashdraft.store import StoreWriter, read_manifest, shard_name, verify_store, write_rejects
from flashdraft.store.files import MANIFEST, SHARDS, array_file, read_shard_attrs, shard_dir
from flashdraft.store.format import decode_index, index_nbytes
from flashdraft.store.projection import PROJECTION_FILE, fit_projection, save_projection
from flashdraft.store.space import DiskFullError
from flashdraft.store.transcode import transcode
from flashdraft.target import target_fingerprint
from pipeline.__main__ import transcode_command, verify_command
from tests.test_faults_writer import command_here, fill, tmpfs  # noqa: F401 - tmpfs: the 2 MiB tmpfs fixture
from tests.test_trainer_fixtures import STORE_LAYERS, VOCAB, H, configs, tiny_target, train_kwargs
from trainer.train import train

REPO = Path(__file__).resolve().parents[1]
SHARD_LENGTHS = [[60, 50, 70, 40], [45, 55, 65, 35], [50, 60, 40, 30]]  # 3 shards of 4 sequences
SEQUENCES, TOKENS = sum(len(lengths) for lengths in SHARD_LENGTHS), sum(map(sum, SHARD_LENGTHS))
PROJECTED = ["dtype=fp8", "project=pca", "project_dims=H", "calibration_tokens=200"]  # the issue's, on 200 tokens
# what the options above resolve to, as the copy's manifest records them and every message repeats them
RESOLVED = f"dtype=float8_e4m3 project=pca project_dims={H} calibration_tokens=200"

# Runs `python -m pipeline ARGS...` with a signal sent to itself once the shard writer of shard NAME got its first
# sequence: argv NAME SIGNAL ARGS... (SIGKILL: a kill mid-store; SIGSTOP: a run held while it writes).
HOOKED_PIPELINE = textwrap.dedent("""
    import os, signal, sys
    from flashdraft.store import writer
    append, name, sig = writer.ShardWriter.append, sys.argv[1], getattr(signal, sys.argv[2])
    def hooked(self, *args, **kwargs):
        append(self, *args, **kwargs)
        if self.name == name and len(self.seq_ids) == 1:
            os.kill(os.getpid(), sig)
    writer.ShardWriter.append = hooked
    sys.argv = ["pipeline", *sys.argv[3:]]
    from pipeline.__main__ import main
    main()
""")


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def pipeline(*args, hook: tuple[str, str] | None = None, wait: bool = True):
    """`python -m pipeline ARGS`, or with `hook` (shard name, signal name) the hooked run, from the repository."""
    cmd = [sys.executable, "-c", HOOKED_PIPELINE, *hook] if hook else [sys.executable, "-m", "pipeline"]
    cmd += [str(a) for a in args]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="module")
def source(tmp_path_factory, target):
    """A raw bf16 store of the tiny target in 3 shards of 4 sequences (one prompt refused), as a capture writes it."""
    path = tmp_path_factory.mktemp("source") / "features"
    extra = {"target": target_fingerprint(str(target)), "vocab_size": VOCAB}
    writer = StoreWriter(
        path, layer_ids=STORE_LAYERS, hidden_size=H, manifest_extra=extra, chunk_tokens=16, shard_tokens=64
    )
    rng = np.random.default_rng(0)
    for k, lengths in enumerate(SHARD_LENGTHS):
        with writer.shard(shard_name(k)) as shard:
            for j, n in enumerate(lengths):
                ids = (rng.integers(0, 60) + np.arange(n)) % 60
                feats = torch.randn(n, len(STORE_LAYERS) * H) * 0.5
                feats[:, :H] += torch.nn.functional.one_hot(torch.as_tensor(ids), H).float() * 3
                shard.append(f"s{k}-{j}", ids, np.arange(n) >= 5, feats)
            if k == 1:
                shard.reject("s1-x", "too long", source="humaneval")
        writer.register(shard.info())
    write_rejects(path, [{"seq_id": "s1-x", "reason": "too long", "source": "humaneval"}])
    assert verify_store(path, progress=False)[0] == []
    return path


@pytest.fixture(scope="module")
def killed(tmp_path_factory, source):
    """The projected fp8 copy of `source` that a transcode SIGKILLed once it listed shard-00000 left (the kill came
    while it wrote shard-00001), and that transcode's result."""
    dst = tmp_path_factory.mktemp("killed") / "copy"
    out = pipeline("transcode", source, dst, *PROJECTED, hook=("shard-00001", "SIGKILL"))
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert [e["name"] for e in read_manifest(dst)["shards"]] == ["shard-00000"]
    assert temp_shards(dst), "the kill came while shard-00001 was written"
    return dst


def partial_copy(killed: Path, tmp_path: Path) -> Path:
    """A copy of the killed transcode's store, for a test to change."""
    dst = tmp_path / "copy"
    shutil.copytree(killed, dst)
    return dst


def temp_shards(store: Path) -> list[str]:
    return [p.name for p in (store / SHARDS).iterdir() if p.name.startswith(".tmp-")]


def tree(store: Path) -> dict:
    """Every file under `store` with its bytes (the lock file's too)."""
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


def partial_says(dst: Path, source: Path, written: int, options: str = RESOLVED) -> str:
    """What `pipeline verify`, the trainer and a stopped transcode say of a partial copy holding `written` shards."""
    return (
        f"{dst} is a partial transcode of {source.resolve()} (the transcode stopped before its end): {written} of 3 "
        f"shards, {4 * written} of {SEQUENCES} sequences written; the same command finishes it: python -m pipeline "
        f"transcode {source.resolve()} {dst} {options}"
    )


def same_shards(a: Path, b: Path) -> None:
    """Stores `a` and `b` hold the same shards, byte for byte (every array's data file and zarr.json), basis and
    rejects."""
    files = lambda store: {p.relative_to(store) for p in (store / SHARDS).rglob("*") if p.is_file()}  # noqa: E731
    assert files(a) == files(b)
    for rel in files(a):
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    for name in (PROJECTION_FILE, "rejects.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_transcode_killed_after_its_first_shard_is_a_partial_store_verify_names(killed, source):
    out = pipeline("verify", killed)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{killed}: 1 problem(s)" in out.stderr and partial_says(killed, source, 1) in out.stderr, out.stderr
    m = read_manifest(killed)["transcoded_from"]
    assert m["complete"] is False and m["counts"]["sequences"] == SEQUENCES and m["shards"] == 3
    # the source, a capture's store, verifies as before
    assert verify_command([str(source)]) == 0


def test_the_trainer_refuses_a_partial_transcode_by_name(killed, source, target, tmp_path, monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29557").items():
        monkeypatch.setenv(k, v)
    kw = train_kwargs(tmp_path, str(killed), target, max_steps=2, epochs=1, eval_every=0)
    with pytest.raises(ValueError) as refused:
        train(*configs(kw, {"num_layers": 2, "block_size": 4}))
    assert str(refused.value).startswith(f"feature store {partial_says(killed, source, 1)}; nothing was trained")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_same_transcode_run_again_finishes_the_killed_one_as_an_uninterrupted_one_writes_it(
    killed, source, tmp_path
):
    dst = partial_copy(killed, tmp_path)
    out = command_here("transcode", source, dst, *PROJECTED)  # the killed process's lock: taken over from here
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{dst}: took over the lock {dst / 'writer.lock'} of an earlier transcode (host " in out.stderr
    assert f"{dst}: removed what a stopped transcode left: .tmp-shard-00001-" in out.stderr
    assert f"{dst}: resuming a partial transcode: 1 of 3 shards already written, 2 to go" in out.stderr
    assert f"{dst}: {SEQUENCES} sequences, {TOKENS} tokens, float8_e4m3, projected to {H} dims" in out.stdout
    assert temp_shards(dst) == [] and not list(dst.glob("*.tmp"))
    assert verify_store(dst, progress=False)[0] == []
    assert read_manifest(dst)["transcoded_from"]["complete"] is True
    whole = tmp_path / "whole"
    transcode(source, whole, dtype="float8_e4m3", project="pca", project_dims="H", calibration_tokens=200)
    same_shards(dst, whole)
    assert read_manifest(dst)["counts"] == read_manifest(whole)["counts"] == read_manifest(source)["counts"]
    # run once more, the copy complete: nothing to write, nothing changed
    before = tree(dst / SHARDS)
    out = command_here("transcode", source, dst, *PROJECTED)
    assert out.returncode == 0 and tree(dst / SHARDS) == before, out.stderr[-3000:]


def wait_stopped(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until `proc` has stopped itself (SIGSTOP); fail with its output if it ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        if proc.poll() is not None:
            pytest.fail(f"the first transcode ended before it stopped: {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    pytest.fail("the first transcode did not stop")


def test_a_second_transcode_into_the_same_store_is_refused_naming_the_first(source, tmp_path):
    dst = tmp_path / "copy"
    first = pipeline("transcode", source, dst, *PROJECTED, hook=("shard-00000", "SIGSTOP"), wait=False)
    try:
        wait_stopped(first)  # held while it writes its first shard, whatever the machine's speed
        before = tree(dst)
        second = command_here("transcode", source, dst, *PROJECTED)  # in this process: another than the first
        assert tree(dst) == before, "the refused transcode changed the store"
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert second.returncode == 1
    holder = json.loads(before["writer.lock"])
    assert f"{dst} is being written by another transcode (host {socket.gethostname()}, pid {first.pid}, " in (
        second.stderr
    )
    assert f"started {holder['started']}; lock {dst / 'writer.lock'})" in second.stderr
    assert verify_store(dst, progress=False)[0] == [] and read_manifest(dst)["counts"]["sequences"] == SEQUENCES


def test_a_copy_begun_from_another_source_or_with_other_options_is_refused_by_name(killed, source, tmp_path, capsys):
    dst = partial_copy(killed, tmp_path)
    before = tree(dst)
    assert transcode_command([str(source), str(dst), "dtype=bf16", *PROJECTED[1:]]) == 1
    err = capsys.readouterr().err
    assert f"{dst} is a transcode of {source} with other options (dtype: {dst} was begun with 'float8_e4m3', this " in (
        err
    )
    assert f"command asks 'bfloat16'): the same command finishes it: python -m pipeline transcode {source}" in err
    assert transcode_command([str(source), str(dst), *PROJECTED[:2], "project_dims=2H", PROJECTED[3]]) == 1
    assert f"(project_dims: {dst} was begun with {H}, this command asks {2 * H})" in capsys.readouterr().err
    other = tmp_path / "other-source"
    shutil.copytree(source, other)
    assert transcode_command([str(other), str(dst), *PROJECTED]) == 1
    err = capsys.readouterr().err
    assert f"{dst} is a transcode of {source.resolve()}, not of {other.resolve()}: finish it from that source" in err
    assert tree(dst) == before, "a refused transcode changed the copy"
    # a capture's store is no transcode's to finish
    assert transcode_command([str(source), str(other), *PROJECTED]) == 1
    assert f"{other} is a feature store that transcode did not write" in capsys.readouterr().err


def flip_features_chunk(store: Path, shard: int) -> bytes:
    """Flip 8 bytes inside inner chunk 1 of shard `shard`'s features (its index intact); returns the file's bytes
    before."""
    d = shard_dir(store, shard_name(shard))
    file = array_file(d, "features", 2)
    n = -(-read_shard_attrs(d)["offsets"][-1] // 16)
    original = file.read_bytes()
    offset, nbytes = decode_index(original[-index_nbytes(n) :], n)[1].astype(int)
    damaged = bytearray(original)
    for i in range(offset + nbytes // 2 - 4, offset + nbytes // 2 + 4):
        damaged[i] ^= 0x5A
    file.write_bytes(bytes(damaged))
    return original


def test_a_bad_chunk_in_the_source_stops_a_partial_copy_that_says_so_and_finishes_once_repaired(
    source, tmp_path, capsys
):
    src = tmp_path / "features"
    shutil.copytree(source, src)
    original = flip_features_chunk(src, 1)
    dst = tmp_path / "copy"
    assert transcode_command([str(src), str(dst), "dtype=fp8"]) == 1
    err = capsys.readouterr().err
    assert f"error: {src}: shard shard-00001, array features, rows 0..45 (sequence s1-0) is unreadable" in err
    assert partial_says(dst, src, 1, "dtype=float8_e4m3") in err, err
    assert temp_shards(dst) == [] and not list(dst.glob("*.tmp"))
    assert verify_command([str(dst)]) == 1
    assert partial_says(dst, src, 1, "dtype=float8_e4m3") in capsys.readouterr().err
    array_file(shard_dir(src, shard_name(1)), "features", 2).write_bytes(original)  # the source repaired
    assert transcode_command([str(src), str(dst), "dtype=fp8"]) == 0
    assert "resuming a partial transcode: 1 of 3 shards already written, 2 to go" in capsys.readouterr().err
    assert verify_command([str(dst)]) == 0


def test_a_full_disk_while_a_transcode_saves_its_basis_is_a_disk_full_error_naming_the_file(
    source,
    tmpfs,  # noqa: F811 - the fixture
):
    dst = tmpfs / "copy"
    filler = fill(tmpfs, leave=24 << 10)  # the manifest fits, the basis (192 x 64 float32, 48 KiB) does not
    with pytest.raises(DiskFullError) as full:
        transcode(source, dst, dtype="float8_e4m3", project="pca", project_dims="H", calibration_tokens=200)
    msg = str(full.value)
    assert msg.startswith(f"no space left on device writing {dst / PROJECTION_FILE}: "), msg
    assert " bytes free there (No space left on device); free space " in msg
    assert partial_says(dst, source, 0) in msg
    assert not (dst / PROJECTION_FILE).exists() and not list(dst.glob("*.tmp")), "a half-written basis is left"
    filler.unlink()
    manifest = transcode(source, dst, dtype="float8_e4m3", project="pca", project_dims="H", calibration_tokens=200)
    assert manifest["transcoded_from"]["complete"] is True and verify_store(dst, progress=False)[0] == []


def test_a_full_disk_while_a_capture_saves_its_basis_is_a_disk_full_error_naming_the_file(tmpfs):  # noqa: F811
    proj = fit_projection(torch.randn(500, len(STORE_LAYERS) * H), H)  # what a capture's worker fits and saves
    store = tmpfs / "features"
    store.mkdir()
    fill(tmpfs, leave=16 << 10)
    with pytest.raises(DiskFullError) as full:
        save_projection(store, proj, layer_ids=STORE_LAYERS, hidden_size=H)
    assert str(full.value).startswith(f"no space left on device writing {store / PROJECTION_FILE}: ")
    assert " bytes free there (No space left on device); free space " in str(full.value)
    assert list(store.iterdir()) == [], "a half-written basis is left"


@pytest.mark.parametrize(
    "option, says",
    [
        (
            "calibration_tokens=abc",
            "calibration_tokens must be a whole number of tokens >= 1 (default 32768), got 'abc'",
        ),
        ("calibration_tokens=0", "calibration_tokens must be a whole number of tokens >= 1 (default 32768), got 0"),
        ("project_dims=abc", "project_dims must be a number or a multiple of H (H, 2H, 2.5H), got 'abc'"),
        ("project_dims=10H", f"project_dims '10H' is {10 * H} dimensions; a projection keeps 1..{3 * H - 1} of the"),
        ("dtype=fp7", "dtype must be one of bf16, fp16, fp8, fp32 (or bfloat16, float16, float8_e4m3, float32), got"),
        ("project=svd", "project must be one of pca (or none), got 'svd'"),
    ],
)
def test_transcode_options_are_checked_naming_the_key(source, tmp_path, capsys, option, says):
    options = {"project": "pca", "project_dims": "H", **dict([option.split("=")])}
    assert transcode_command([str(source), str(tmp_path / "copy"), *(f"{k}={v}" for k, v in options.items())]) == 1
    assert f"error: {says}" in capsys.readouterr().err
    assert not (tmp_path / "copy").exists(), "a refused transcode created its store"
    # a fit's settings without a fit are refused, not ignored
    assert transcode_command([str(source), str(tmp_path / "copy"), "calibration_tokens=100"]) == 1
    assert "error: calibration_tokens=100 given without project=pca" in capsys.readouterr().err


def test_a_manifest_a_stopped_transcode_left_half_written_is_no_obstacle(killed, source, tmp_path):
    dst = partial_copy(killed, tmp_path)
    (dst / f"{MANIFEST}.1234abcd.tmp").write_text("{")  # a kill while the manifest was replaced
    out = command_here("transcode", source, dst, *PROJECTED)
    assert out.returncode == 0 and f"{MANIFEST}.1234abcd.tmp" in out.stderr, out.stderr[-3000:]
    assert not list(dst.glob("*.tmp")) and verify_store(dst, progress=False)[0] == []
