"""Checking a store end to end: manifest vs shards, every array's data file present with a sound index, every
inner chunk readable (crc32c, decompression) and features finite; a transcoded copy holding all of its source."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashdraft.store.files import (
    array_file,
    dir_bytes,
    listed_shard_attrs,
    read_manifest,
    repair_hint,
    shard_dir,
    shards_bytes,
)
from flashdraft.store.format import (
    FEATURE_SCALES,
    FEATURES,
    StoreError,
    StoreLayout,
    index_nbytes,
    mask_runs,
    read_index,
)
from flashdraft.store.projection import load_projection
from flashdraft.store.transcode import partial_transcode_problem


@dataclass
class _Check:
    """One verify run's state: the store, what to read of each array, what was found and what was read."""

    path: Path
    layout: StoreLayout
    sample: tuple[float, np.random.Generator] | None  # (fraction, rng): that share of each array's chunks; None: all
    problems: list = field(default_factory=list)
    seen: dict = field(default_factory=dict)  # sequence id -> the shard holding it
    tally: Counter = field(default_factory=Counter)  # shards, sequences, tokens, indexes, chunks, chunks_total, bytes

    def chunks_to_read(self, n: int) -> np.ndarray:
        if self.sample is None:
            return np.arange(n)
        fraction, rng = self.sample
        return np.sort(rng.choice(n, size=min(n, max(1, round(fraction * n))), replace=False))


def verify_store(
    path: str | Path, *, progress: bool = True, part: tuple[int, int] = (0, 1), sample=None
) -> tuple[list[str], dict]:
    """Check a store end to end. Returns (problems, stats); no problems means the store is sound.

        Manifest vs shards (listed shards exist, are complete and agree on counts), every data file present with
        an intact index, every inner chunk readable (crc32c, decompression), offsets monotonic, features finite,
        response spans equal to the loss mask, sequence ids unique, a projected store's basis hashing to its manifest's
    sha256, a transcoded store complete (every shard of its source written: `partial_transcode_problem` names a
    partial one and the command that finishes it). `part` (k, n) checks only every n-th listed shard
        from the k-th, so that n processes share the work: each shard against its manifest entry, the entries against
        the manifest's counts in part 0; sequence ids are then found unique within a part only. `sample` (fraction,
        rng) reads that share of each array's inner chunks (at least one) instead of all of them, and skips the span
        check (it needs the whole loss mask).
    """
    from tqdm import tqdm

    try:
        manifest = read_manifest(path)
        layout = StoreLayout.from_manifest(manifest)
    except (StoreError, TypeError, KeyError) as e:
        return [str(e)], {}
    check = _Check(Path(path), layout, sample)
    k, n = part
    if k == 0:
        try:  # a projected store's basis: present, and hashing to the manifest's sha256
            load_projection(path, manifest)
        except StoreError as e:
            check.problems.append(str(e))
        partial = partial_transcode_problem(path, manifest)  # None for a capture's store
        if partial:
            check.problems.append(partial)
    shards = manifest["shards"][k::n]
    for entry in tqdm(shards, desc="verify", unit="shard", disable=not progress):
        _check_shard(check, entry)
    held = (check.tally["sequences"], check.tally["tokens"])
    if k == 0:
        _check_counts(manifest, held if n == 1 else None, check.problems)
    size = shards_bytes(path) if n == 1 else sum(dir_bytes(shard_dir(path, e["name"])) for e in shards)
    return check.problems, {**check.tally, "shards": len(shards), "bytes_on_disk": size}


def listed_shard_problems(path: str | Path, manifest: dict, progress: bool = False):
    """(entry, its problems) for each shard `manifest` lists, checked as `verify_store` checks it (every inner chunk
    read); what `pipeline repair` drops."""
    from tqdm import tqdm

    check = _Check(Path(path), StoreLayout.from_manifest(manifest), sample=None)
    for entry in tqdm(manifest["shards"], desc="repair: checking", unit="shard", disable=not progress):
        before = len(check.problems)
        _check_shard(check, entry)
        yield entry, check.problems[before:]


def _check_shard(check: _Check, entry: dict) -> None:
    """Problems of one listed shard go to `check.problems`; its sequences and tokens to `check.tally`."""
    name, d, problems = entry["name"], shard_dir(check.path, entry["name"]), check.problems
    if not d.is_dir():
        problems.append(f"shard {name} is listed in the manifest but missing on disk; {repair_hint(check.path)}")
        return
    try:
        attrs = listed_shard_attrs(check.path, name)
    except StoreError as e:
        problems.append(str(e))
        return
    if not attrs.get("complete"):
        problems.append(f"shard {name} is not marked complete")
    offsets = np.asarray(attrs.get("offsets", []), dtype=np.int64)
    ids = attrs.get("seq_ids", [])
    T = int(offsets[-1]) if len(offsets) else 0
    if len(offsets) != len(ids) + 1 or (len(offsets) and offsets[0] != 0) or (np.diff(offsets) <= 0).any():
        problems.append(f"shard {name}: offsets are not 0-based, strictly increasing, one per sequence + 1")
    if entry["sequences"] != len(ids) or entry["tokens"] != T:
        problems.append(
            f"shard {name}: manifest says {entry['sequences']} sequences / {entry['tokens']} tokens, "
            f"shard holds {len(ids)} / {T}"
        )
    for s in ids:
        if s in check.seen:
            problems.append(f"sequence {s} is in both {check.seen[s]} and {name}")
        check.seen[s] = name
    mask = None
    for key in check.layout.array_keys():
        rows = _check_array(check, d, key, T)
        mask = rows if key == "loss_mask" else mask
    if mask is not None and "response_spans" in attrs and len(offsets) == len(ids) + 1:
        _check_spans(d, attrs["response_spans"], mask.astype(bool), offsets, ids, problems)
    thinking = attrs.get("thinking")
    if thinking is not None and (len(thinking) != len(ids) or any(t not in (True, False, None) for t in thinking)):
        problems.append(f"shard {name}: thinking must hold true, false or null for each of its {len(ids)} sequences")
    check.tally.update(sequences=len(ids), tokens=T)


def _check_spans(d: Path, spans: list, mask: np.ndarray, offsets: np.ndarray, ids: list, problems: list) -> None:
    """The shard's response-span index (what the trainer plans from) equals its loss_mask, sequence by sequence."""
    if len(spans) != len(ids):
        problems.append(f"shard {d.name}: response_spans hold {len(spans)} entries for {len(ids)} sequences")
        return
    wrong = [s for j, s in enumerate(ids) if spans[j] != mask_runs(mask[offsets[j] : offsets[j + 1]])]
    if wrong:
        problems.append(
            f"shard {d.name}: response_spans disagree with loss_mask for {len(wrong)} sequences "
            f"({', '.join(wrong[:5])})"
        )


def _check_array(check: _Check, d: Path, key: str, T: int) -> np.ndarray | None:
    """The one data file of array `key` of shard folder `d` is there, its index sound, and the inner chunks to read
    (all, or the sample) readable (checksum, decompression) and finite; a problem names the shard, the array and
    the chunk's rows. Chunks are read straight from the file, as the reader reads them. Returns the array's rows
    when every chunk was read and sound, else None."""
    import zarr

    where, problems = f"shard {d.name}: array {key}", check.problems
    try:
        arr = zarr.open_array(str(d / key), mode="r")
    except Exception as e:  # noqa: BLE001 - any failure to open is a problem to report
        problems.append(f"{where} cannot be opened ({type(e).__name__}: {e})")
        return None
    if arr.shape[0] != T:
        problems.append(f"{where} has {arr.shape[0]} rows, offsets say {T}")
        return None
    if T == 0:
        return None
    file, ct = array_file(d, key, arr.ndim), arr.chunks[0]
    entries = _check_index(file, T, ct, check.path, where, problems)
    if entries is None:
        return None
    check.tally["indexes"] += 1
    dtype, row = check.layout.array_specs()[key]
    chosen, blocks = check.chunks_to_read(len(entries)), []
    check.tally.update(chunks=len(chosen), chunks_total=len(entries))
    with open(file, "rb") as f:
        for c in chosen.tolist():
            a, b = c * ct, min(T, (c + 1) * ct)
            f.seek(int(entries[c, 0]))
            data = f.read(int(entries[c, 1]))
            check.tally["bytes"] += len(data)
            try:
                blocks.append(check.layout.decode_chunk(data, dtype, row)[: b - a])
            except (StoreError, ValueError, RuntimeError) as e:
                problems.append(f"{where}: chunk {c} (rows {a}..{b}) is unreadable ({type(e).__name__}: {e})")
                continue
            _check_values(blocks[-1], key, check.layout, f"{where} rows {a}..{b}", problems)
    return np.concatenate(blocks) if len(blocks) == len(entries) else None


def _check_index(file: Path, T: int, rows: int, path: Path, where: str, problems: list) -> np.ndarray | None:
    """The data file exists and its shard index is intact and lists all its inner chunks (`rows` each, T rows in
    all) inside the file: the index's (offset, nbytes) entries, or None after reporting why not."""
    n = -(-T // rows)
    if not file.is_file():
        problems.append(f"{where}: data file {file.relative_to(path)} is missing")
        return None
    size = file.stat().st_size
    try:
        entries = read_index(file, n)
    except StoreError as e:
        problems.append(f"{where}: data file {file.relative_to(path)} is corrupt ({e}): rows 0..{T} unreadable")
        return None
    empty = entries[:, 0] == np.uint64(2**64 - 1)  # zarr's mark of a chunk never written
    bad = np.flatnonzero(empty | (entries[:, 1] == 0) | (np.where(empty, 0, entries.sum(1)) > size - index_nbytes(n)))
    for c in bad[:10]:
        problems.append(f"{where}: chunk {c} (rows {c * rows}..{(c + 1) * rows}) is missing from the shard index")
    return None if len(bad) else entries


def _check_values(block: np.ndarray, key: str, layout: StoreLayout, where: str, problems: list) -> None:
    if key == FEATURES and not _all_finite(block, layout.dtype):
        problems.append(f"{where} hold NaN/Inf")
    elif key == FEATURE_SCALES and not (np.isfinite(block).all() and (block > 0).all()):
        problems.append(f"{where}: non-positive or non-finite fp8 scales")


def _all_finite(stored: np.ndarray, dtype: str) -> bool:
    """Whether stored features hold no NaN/Inf, read from their bits (no conversion): a bf16 whose exponent bits are
    all set, an fp8 e4m3fn whose exponent and mantissa bits are (its NaN; it has no Inf)."""
    if dtype == "bfloat16":
        return not ((stored & 0x7F80) == 0x7F80).any()
    if dtype == "float8_e4m3":
        return not ((stored & 0x7F) == 0x7F).any()
    return bool(np.isfinite(stored).all())


def _check_counts(manifest: dict, held: tuple[int, int] | None, problems: list) -> None:
    """The manifest's counts agree with what the shards hold (None: not known here) and with its own shard entries."""
    c = manifest.get("counts", {})
    shards = manifest["shards"]
    listed = (sum(e["sequences"] for e in shards), sum(e["tokens"] for e in shards))
    for what, n in (("shards hold", held), ("shard entries sum to", listed)):
        if n is None:
            continue
        if (c.get("sequences"), c.get("tokens")) != n:
            problems.append(
                f"manifest counts {c.get('sequences')} sequences / {c.get('tokens')} tokens, {what} {n[0]} / {n[1]}"
            )
