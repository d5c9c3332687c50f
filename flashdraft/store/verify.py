"""Checking a store end to end: manifest vs shards, every array's data file present with a sound index, every
inner chunk readable (crc32c, decompression) and features finite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from flashdraft.store.files import array_file, dir_bytes, read_manifest, read_shard_attrs, shard_dir, shards_bytes
from flashdraft.store.format import (
    FEATURE_SCALES,
    FEATURES,
    StoreError,
    StoreLayout,
    decode_features,
    decode_index,
    index_nbytes,
    mask_runs,
)


def verify_store(path: str | Path, *, progress: bool = True, part: tuple[int, int] = (0, 1)) -> tuple[list[str], dict]:
    """Check a store end to end. Returns (problems, stats); no problems means the store is sound.

    Manifest vs shards (listed shards exist, are complete and agree on counts), every data file present with
    an intact index, every inner chunk readable, offsets monotonic, features finite, sequence ids unique.
    `part` (k, n) checks only every n-th listed shard from the k-th, so that n processes share the work: each shard
    against its manifest entry, the entries against the manifest's counts in part 0; sequence ids are then found
    unique within a part only.
    """
    from tqdm import tqdm

    try:
        manifest = read_manifest(path)
        layout = StoreLayout.from_manifest(manifest)
    except (StoreError, TypeError, KeyError) as e:
        return [str(e)], {}
    path = Path(path)
    problems: list[str] = []
    seen: dict[str, str] = {}  # sequence id -> the shard holding it
    total_seq = total_tok = 0
    k, n = part
    shards = manifest["shards"][k::n]
    for entry in tqdm(shards, desc="verify", unit="shard", disable=not progress):
        counted = _check_shard(path, entry, layout, seen, problems)
        if counted is not None:
            total_seq += counted[0]
            total_tok += counted[1]
    if k == 0:
        _check_counts(manifest, (total_seq, total_tok) if n == 1 else None, problems)
    size = shards_bytes(path) if n == 1 else sum(dir_bytes(shard_dir(path, e["name"])) for e in shards)
    stats = {"shards": len(shards), "sequences": total_seq, "tokens": total_tok, "bytes": size}
    return problems, stats


def _check_shard(path: Path, entry: dict, layout: StoreLayout, seen: dict, problems: list) -> tuple[int, int] | None:
    """Problems of one listed shard go to `problems`; returns its (sequences, tokens), None if it is unreadable."""
    name, d = entry["name"], shard_dir(path, entry["name"])
    if not d.is_dir():
        problems.append(f"shard {name} is listed in the manifest but missing on disk")
        return None
    try:
        attrs = read_shard_attrs(d)
    except StoreError as e:
        problems.append(str(e))
        return None
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
        if s in seen:
            problems.append(f"sequence {s} is in both {seen[s]} and {name}")
        seen[s] = name
    for key in layout.array_keys():
        _check_array(path, d, key, T, layout, problems)
    if "response_spans" in attrs and len(offsets) == len(ids) + 1:
        _check_spans(d, attrs["response_spans"], offsets, ids, problems)
    return len(ids), T


def _check_spans(d: Path, spans: list, offsets: np.ndarray, ids: list, problems: list) -> None:
    """The shard's response-span index (what the trainer plans from) equals its loss_mask, sequence by sequence."""
    import zarr

    try:
        mask = np.asarray(zarr.open_array(str(d / "loss_mask"), mode="r")[:], dtype=bool)
    except Exception:  # noqa: BLE001 - an unreadable loss_mask is reported by _check_array
        return
    if len(spans) != len(ids):
        problems.append(f"shard {d.name}: response_spans hold {len(spans)} entries for {len(ids)} sequences")
        return
    wrong = [s for j, s in enumerate(ids) if spans[j] != mask_runs(mask[offsets[j] : offsets[j + 1]])]
    if wrong:
        problems.append(
            f"shard {d.name}: response_spans disagree with loss_mask for {len(wrong)} sequences "
            f"({', '.join(wrong[:5])})"
        )


def _check_array(path: Path, d: Path, key: str, T: int, layout: StoreLayout, problems: list) -> None:
    """The one data file of array `key` of shard folder `d` is there, its index sound, and every inner chunk
    readable (checksum, decompression) and finite; a problem names the shard, the array and the chunk's rows."""
    import zarr

    name = d.name
    try:
        arr = zarr.open_array(str(d / key), mode="r")
    except Exception as e:  # noqa: BLE001 - any failure to open is a problem to report
        problems.append(f"shard {name}: array {key} cannot be opened ({type(e).__name__}: {e})")
        return
    if arr.shape[0] != T:
        problems.append(f"shard {name}: array {key} has {arr.shape[0]} rows, offsets say {T}")
        return
    if T == 0:
        return
    where = f"shard {name}: array {key}"
    if not _check_index(array_file(d, key, arr.ndim), T, arr.chunks[0], path, where, problems):
        return
    step = layout.shard_tokens - layout.shard_tokens % arr.chunks[0] or arr.chunks[0]
    for a in range(0, T, step):
        try:
            block = arr[a : min(T, a + step)]
        except Exception:  # noqa: BLE001 - find the inner chunks at fault
            _locate_bad_chunks(arr, a, min(T, a + step), where, problems)
            continue
        _check_values(block, key, layout, f"{where} rows {a}..{a + len(block)}", problems)


def _check_index(file: Path, T: int, rows: int, path: Path, where: str, problems: list) -> bool:
    """The data file exists and its shard index is intact and lists all its inner chunks (`rows` each, T rows in
    all) inside the file."""
    n = -(-T // rows)
    if not file.is_file():
        problems.append(f"{where}: data file {file.relative_to(path)} is missing")
        return False
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            f.seek(max(0, size - index_nbytes(n)))
            entries = decode_index(f.read(), n)
    except StoreError as e:
        problems.append(f"{where}: data file {file.relative_to(path)} is corrupt ({e}): rows 0..{T} unreadable")
        return False
    empty = entries[:, 0] == np.uint64(2**64 - 1)  # zarr's mark of a chunk never written
    bad = np.flatnonzero(empty | (entries[:, 1] == 0) | (np.where(empty, 0, entries.sum(1)) > size - index_nbytes(n)))
    for c in bad[:10]:
        problems.append(f"{where}: chunk {c} (rows {c * rows}..{(c + 1) * rows}) is missing from the shard index")
    return len(bad) == 0


def _locate_bad_chunks(arr, a: int, b: int, where: str, problems: list) -> None:
    rows = arr.chunks[0]
    for c0 in range(a, b, rows):
        try:
            arr[c0 : min(b, c0 + rows)]
        except Exception as e:  # noqa: BLE001
            problems.append(
                f"{where}: chunk {c0 // rows} (rows {c0}..{min(b, c0 + rows)}) is unreadable ({type(e).__name__}: {e})"
            )


def _check_values(block: np.ndarray, key: str, layout: StoreLayout, where: str, problems: list) -> None:
    if key == FEATURES:
        vals = decode_features(block, layout.dtype, np.ones((len(block), len(layout.layer_ids)), np.float32))
        if not torch.isfinite(vals).all():
            problems.append(f"{where} hold NaN/Inf")
    elif key == FEATURE_SCALES and not (np.isfinite(block).all() and (block > 0).all()):
        problems.append(f"{where}: non-positive or non-finite fp8 scales")


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
