"""Checking a store end to end: manifest vs shards, every chunk file present and readable, features finite."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from flashdraft.store.files import read_manifest, read_shard_attrs, shard_dir, shards_bytes
from flashdraft.store.format import StoreError, StoreLayout, decode_layer


def verify_store(path: str | Path, *, progress: bool = True) -> tuple[list[str], dict]:
    """Check a store end to end. Returns (problems, stats); no problems means the store is sound.

    Manifest vs shards (listed shards exist, are complete and agree on counts), every chunk file
    present and readable, offsets monotonic, features finite, sequence ids unique.
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
    shards = manifest["shards"]
    for entry in tqdm(shards, desc="verify", unit="shard", disable=not progress):
        counted = _check_shard(path, entry, layout, seen, problems)
        if counted is not None:
            total_seq += counted[0]
            total_tok += counted[1]
    _check_counts(manifest, (total_seq, total_tok), problems)
    stats = {"shards": len(shards), "sequences": total_seq, "tokens": total_tok, "bytes": shards_bytes(path)}
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
    return len(ids), T


def _check_array(path: Path, d: Path, key: str, T: int, layout: StoreLayout, problems: list) -> None:
    """Every chunk file of the array `key` of shard folder `d` is there, readable and finite."""
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
    outer = (arr.shards or arr.chunks)[0]
    for c in range(math.ceil(T / outer)):
        chunk_file = d / key / "c" / str(c) / "0" if arr.ndim == 2 else d / key / "c" / str(c)
        if not chunk_file.is_file():
            problems.append(f"shard {name}: chunk file {chunk_file.relative_to(path)} is missing")
            continue
        try:
            block = arr[c * outer : min(T, (c + 1) * outer)]
        except Exception as e:  # noqa: BLE001
            problems.append(f"shard {name}: chunk {key}/c/{c} is unreadable ({type(e).__name__}: {e})")
            continue
        if key.startswith("layer_") and not key.endswith("_scale"):
            vals = decode_layer(block, layout.dtype, np.ones(len(block), np.float32))
            if not torch.isfinite(vals).all():
                problems.append(f"shard {name}: {key} rows {c * outer}..{c * outer + len(block)} hold NaN/Inf")
        elif key.endswith("_scale") and not (np.isfinite(block).all() and (block > 0).all()):
            problems.append(f"shard {name}: {key} holds non-positive or non-finite scales")


def _check_counts(manifest: dict, held: tuple[int, int], problems: list) -> None:
    """The manifest's counts agree with what the shards hold and with its own shard entries."""
    c = manifest.get("counts", {})
    shards = manifest["shards"]
    listed = (sum(e["sequences"] for e in shards), sum(e["tokens"] for e in shards))
    for what, n in (("shards hold", held), ("shard entries sum to", listed)):
        if (c.get("sequences"), c.get("tokens")) != n:
            problems.append(
                f"manifest counts {c.get('sequences')} sequences / {c.get('tokens')} tokens, {what} {n[0]} / {n[1]}"
            )
