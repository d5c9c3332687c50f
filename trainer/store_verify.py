"""The feature stores' bytes before step 1 (`train.verify_store`): every inner chunk (`full`, the store's own
`verify_store`), or every shard's attributes, every array's shard index and a random share of the inner chunks
(`sample`). The shards are split over the ranks; the problems are gathered so that every rank stops alike, before
anything is trained, with one error that lists them (store, shard, array, rows)."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from flashdraft.store import StoreError, verify_store

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
        sample = None if mode == "full" else (fraction, rng)
        found, stats = verify_store(path, progress=False, part=(rank, world), sample=sample)
        problems += [f"{path}: {p}" for p in found]
        checked.update(stats)
    problems, checked = gathered(problems, checked)
    checked.update(stores=len(set(map(str, paths))), seconds=time.perf_counter() - t0, ranks=world)
    if rank == 0:
        print(f"train.verify_store={mode}: {describe(mode, checked, fraction)}", flush=True)
    if problems:
        more = f"\n  ... and {len(problems) - LISTED} more" if len(problems) > LISTED else ""
        damaged = [p for p in dict.fromkeys(str(p) for p in paths) if any(q.startswith(f"{p}: ") for q in problems)]
        repairs = "; ".join(f"python -m pipeline repair {p}" for p in damaged)
        raise CorruptStore(
            f"train.verify_store={mode} found {len(problems)} problem(s) in the feature stores; nothing was "
            f"trained:\n  " + "\n  ".join(problems[:LISTED]) + more + "\nRecapture the shards named: "
            f"{repairs or 'python -m pipeline repair STORE'} drops every missing or damaged shard (moving its folder "
            "aside), then the same capture command run again captures exactly their prompts; python -m pipeline "
            "verify STORE lists every problem. Or train on the other stores"
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
