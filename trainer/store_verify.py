"""The feature stores' bytes before step 1 (`train.verify_store`): every inner chunk (`full`, the store's own
`verify_store`), or every shard's attributes, every array's shard index and a random share of the inner chunks
(`sample`). The shards are split over the ranks; the problems are gathered so that every rank stops alike, before
anything is trained, with one error that lists them (store, shard, array, rows)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np

from flashdraft.store import StoreError, StoreLayout, read_manifest, verify_store
from flashdraft.store.files import array_file, read_shard_attrs, shard_dir
from flashdraft.store.format import decode_index, index_nbytes

MODES = ("full", "sample", "off")
LISTED = 50  # problems the error lists; the rest are counted


class CorruptStore(StoreError):
    """A feature store failed its check before step 1; the message lists the problems."""


def verify_stores(paths, mode: str, *, fraction: float, rank: int = 0, world: int = 1) -> dict:
    """Check the stores at `paths` as `mode` says, this rank taking every `world`-th shard from its `rank`; raise
    CorruptStore on every rank when any found a problem. Returns what was checked, summed over the ranks."""
    if mode not in MODES:
        raise ValueError(f"train.verify_store must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return {}
    t0 = time.perf_counter()
    rng = np.random.default_rng()  # unseeded: a rerun samples other chunks
    problems, checked = [], Counter()
    for path in dict.fromkeys(str(p) for p in paths):  # a store given twice (train and eval) is checked once
        if mode == "full":
            found, stats = verify_store(path, progress=False, part=(rank, world))
        else:
            found, stats = sample_store(path, fraction, (rank, world), rng)
        problems += [f"{path}: {p}" for p in found]
        checked.update(stats)
    problems, checked = gathered(problems, checked)
    checked.update(stores=len(set(map(str, paths))), seconds=time.perf_counter() - t0, ranks=world)
    if rank == 0:
        print(f"train.verify_store={mode}: {describe(mode, checked, fraction)}", flush=True)
    if problems:
        more = f"\n  ... and {len(problems) - LISTED} more" if len(problems) > LISTED else ""
        raise CorruptStore(
            f"train.verify_store={mode} found {len(problems)} problem(s) in the feature stores; nothing was "
            f"trained:\n  " + "\n  ".join(problems[:LISTED]) + more + "\nRecapture the shards named (python -m "
            "pipeline verify STORE lists every problem), or train on the other stores"
        )
    return dict(checked)


def describe(mode: str, checked: Counter, fraction: float) -> str:
    """One line: what was checked, and how long it took."""
    took = f"in {checked['seconds']:.1f} s on {checked['ranks']} rank(s)"
    mib = checked["bytes"] / 2**20
    if mode == "full":
        return (
            f"every inner chunk of {checked['stores']} store(s), {checked['shards']} shards, "
            f"{checked['tokens']:,} tokens, {mib:,.1f} MiB, {took}"
        )
    return (
        f"{checked['shards']} shards' attributes and {checked['indexes']} shard indexes of {checked['stores']} "
        f"store(s), {checked['chunks']:,} of {checked['chunks_total']:,} inner chunks (verify_sample={fraction}, "
        f"{mib:,.1f} MiB read), {took}"
    )


def gathered(problems: list[str], checked: Counter) -> tuple[list[str], Counter]:
    """Every rank's problems and counts, on every rank (as they are, in one process)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return problems, checked
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (problems, dict(checked)))
    return [p for found, _ in parts for p in found], sum((Counter(c) for _, c in parts), Counter())


def sample_store(path, fraction: float, part: tuple[int, int], rng) -> tuple[list[str], Counter]:
    """(problems, counts) of the listed shards of part (k, n): their attributes, every array's index, and a random
    `fraction` of each array's inner chunks (at least one) read and checked (crc32c, decompression)."""
    checked = Counter()
    try:
        manifest = read_manifest(path)
        layout = StoreLayout.from_manifest(manifest)
    except (StoreError, TypeError, KeyError) as e:
        return [str(e)], checked
    problems: list[str] = []
    k, n = part
    for entry in manifest["shards"][k::n]:
        checked["shards"] += 1
        rows = shard_rows(Path(path), entry, problems)
        folder = shard_dir(path, entry["name"])
        for key, spec in layout.array_specs().items() if rows else ():
            sample_array(folder, key, spec, rows, layout, (fraction, rng), problems, checked)
    return problems, checked


def shard_rows(path: Path, entry: dict, problems: list) -> int | None:
    """The rows of a listed shard, from its attributes, when they are readable, complete and agree with the
    manifest entry; else None and the problem."""
    name = entry["name"]
    try:
        attrs = read_shard_attrs(shard_dir(path, name))
    except StoreError as e:
        problems.append(str(e))
        return None
    offsets, ids = attrs.get("offsets", []), attrs.get("seq_ids", [])
    rows = int(offsets[-1]) if offsets else 0
    if not attrs.get("complete"):
        problems.append(f"shard {name} is not marked complete")
        return None
    if len(offsets) != len(ids) + 1 or (entry["sequences"], entry["tokens"]) != (len(ids), rows):
        problems.append(
            f"shard {name}: manifest says {entry['sequences']} sequences / {entry['tokens']} tokens, shard holds "
            f"{len(ids)} / {rows} ({len(offsets)} offsets)"
        )
        return None
    return rows


def sample_array(d: Path, key: str, spec, rows: int, layout: StoreLayout, sample, problems: list, checked) -> None:
    """Array `key` of shard folder `d`: its data file's index intact and inside the file, then `sample` =
    (fraction, rng) of its inner chunks read and decoded; a problem names the shard, the array and the rows."""
    dtype, row = spec
    fraction, rng = sample
    ct, where = layout.chunk_tokens, f"shard {d.name}: array {key}"
    n = -(-rows // ct)
    file = array_file(d, key, 1 + len(row))
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            f.seek(max(0, size - index_nbytes(n)))
            entries = decode_index(f.read(), n).astype(np.int64)  # a never-written chunk's offset (2**64-1) is -1
            checked["indexes"] += 1
            bad = np.flatnonzero((entries[:, 0] < 0) | (entries[:, 1] <= 0) | (entries.sum(1) > size - index_nbytes(n)))
            for c in bad[:10]:
                problems.append(f"{where}: chunk {c} (rows {c * ct}..{min(rows, (c + 1) * ct)}) is not in the file")
            if len(bad):
                return
            checked["chunks_total"] += n
            for c in np.sort(rng.choice(n, size=min(n, max(1, round(fraction * n))), replace=False)):
                f.seek(entries[c, 0])
                data = f.read(entries[c, 1])
                checked["chunks"] += 1
                checked["bytes"] += len(data)
                try:
                    layout.decode_chunk(data, dtype, row)
                except (StoreError, ValueError, RuntimeError) as e:
                    problems.append(
                        f"{where}: chunk {c} (rows {c * ct}..{min(rows, (c + 1) * ct)}) is unreadable "
                        f"({type(e).__name__}: {e})"
                    )
    except (OSError, StoreError) as e:
        problems.append(
            f"{where}: data file {file.relative_to(d.parent.parent)} is missing or corrupt ({e}): rows 0..{rows} "
            "unreadable"
        )
