"""Anchor positions: where the training blocks start.

A block `[input_ids[p], MASK x (B-1)]` anchored at p predicts input_ids[p+1 .. p+B-1], so p is a
valid anchor when the block fits in the sequence (p <= S-B) and the token after it is a response
token (loss_mask[p+1]). Each epoch draws up to `num_anchors` of them without replacement, from a
generator seeded by (seed, epoch, sequence id) alone: every rank, every restart, draws the same.

Serving does not start blocks uniformly: a round starts at the token the target had to correct, so rounds
gather where the text is hard to predict, and a long easy run costs one round however long it is.
`hard_start_weights` lets training draw anchors the same way, from the target's own uncertainty;
`follow_anchors` moves anchors to where the drafter's own next round would start (the trainer probes the drafter
on the drawn anchors first).
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


def hard_start_weights(teacher_logp: np.ndarray, uniform_share: float) -> np.ndarray:
    """Per position p, a weight for anchoring a block at p: `uniform_share` of it the same everywhere, the rest
    in proportion to 1 - P(the target's top token) when it produced token p (teacher_logp[p - 1, 0]), so blocks
    start more often where a served round would: after a token the drafter likely missed."""
    if not 0.0 <= uniform_share <= 1.0:
        raise ValueError(f"uniform_share must be in [0, 1], got {uniform_share}")
    top1 = np.exp(np.asarray(teacher_logp[:, 0], dtype=np.float64))
    hard = np.concatenate([[1.0], 1.0 - top1[:-1]]).clip(0.0, 1.0)
    return uniform_share + (1.0 - uniform_share) * hard / max(hard.mean(), 1e-6)


def draw_anchors(loss_mask: np.ndarray, block_size: int, num_anchors: int, *, seed: int, epoch: int, seq_id: str,
                 weights: np.ndarray | None = None) -> np.ndarray:
    """Up to `num_anchors` valid anchors, sorted, drawn without replacement; redrawn per epoch.
    weights: per position, relative chances of being drawn (None: uniform, the paper's)."""
    valid = valid_anchor_positions(loss_mask, block_size)
    if len(valid) <= num_anchors:
        return valid
    rng = np.random.default_rng(stable_seed("anchors", seed, epoch, seq_id))
    p = None
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)[valid] + 1e-9
        p = w / w.sum()
    return np.sort(rng.choice(valid, size=num_anchors, replace=False, p=p))


def follow_anchors(loss_mask: np.ndarray, block_size: int, anchors: np.ndarray, accepted: np.ndarray, share: float, *,
                   seed: int, epoch: int, seq_id: str) -> np.ndarray:
    """Anchors where served rounds would start next: a round anchored at a whose drafts k = 1..L matched starts
    the next one at a + L + 1 (the token the target corrected, or the one after a fully accepted block). A
    `share` of the anchors, picked by a generator seeded like `draw_anchors`, move there; one whose follow-on is
    no valid anchor or is taken stays, and one whose own place a follow-on took is dropped. Sorted, no repeats."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"follow share must be in [0, 1], got {share}")
    anchors = np.asarray(anchors, dtype=np.int64)
    n_move = int(round(share * len(anchors)))
    if n_move == 0:
        return anchors
    rng = np.random.default_rng(stable_seed("follow", seed, epoch, seq_id))
    moving = np.zeros(len(anchors), dtype=bool)
    moving[rng.choice(len(anchors), size=n_move, replace=False)] = True
    valid = set(valid_anchor_positions(loss_mask, block_size).tolist())
    taken = set(anchors[~moving].tolist())
    for a, n_ok in zip(anchors[moving].tolist(), np.asarray(accepted)[moving].tolist()):
        nxt = a + int(n_ok) + 1
        if nxt in valid and nxt not in taken:
            taken.add(nxt)
        else:
            taken.add(a)
    return np.array(sorted(taken), dtype=np.int64)
