"""Anchor positions: where the training blocks start.

A block `[input_ids[p], MASK x (B-1)]` anchored at p predicts input_ids[p+1 .. p+B-1], so p is a
valid anchor when the block fits in the sequence (p <= S-B) and the token after it is a response
token (loss_mask[p+1]). Each epoch draws up to `num_anchors` of them without replacement, from a
generator seeded by (seed, epoch, sequence id) alone: every rank, every restart, draws the same.
"""

from __future__ import annotations

import hashlib

import numpy as np


def stable_seed(*parts) -> int:
    """A 64-bit seed from the parts' text, the same in every process (unlike `hash`)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def valid_anchor_positions(loss_mask: np.ndarray, block_size: int) -> np.ndarray:
    """All p with p <= S - block_size and loss_mask[p + 1]."""
    last = len(loss_mask) - block_size
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (one anchor plus predictions), got {block_size}")
    if last < 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.asarray(loss_mask[1 : last + 2], dtype=bool)).astype(np.int64)


def count_valid_anchors(loss_mask: np.ndarray, block_size: int) -> int:
    return len(valid_anchor_positions(loss_mask, block_size))


def draw_anchors(
    loss_mask: np.ndarray, block_size: int, num_anchors: int, *, seed: int, epoch: int, seq_id: str
) -> np.ndarray:
    """Up to `num_anchors` valid anchors, sorted, drawn uniformly without replacement; redrawn per epoch."""
    valid = valid_anchor_positions(loss_mask, block_size)
    if len(valid) <= num_anchors:
        return valid
    rng = np.random.default_rng(stable_seed("anchors", seed, epoch, seq_id))
    return np.sort(rng.choice(valid, size=num_anchors, replace=False))
