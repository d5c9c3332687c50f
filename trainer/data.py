"""Training data: sequences from one or more feature stores, planned into micro-batches per rank.

The plan of an epoch depends only on shared metadata (lengths, loss masks, seq ids) and
(seed, epoch), so every rank computes the same plan and takes its own part of it:

1. Skip sequences with no valid anchor, and held-out ones (a stable hash of the seq id).
2. Shuffle, sort by cost inside windows of 64 x rows, and cut micro-batches whose padded cost
   rows x (S_max + N_max * B) stays within the token budget; shuffle the micro-batches.
3. Global step t, accumulation slot a, rank r reads micro-batch (t * accum + a) * world + r. The
   list wraps around to fill the last step, so every rank runs the same number of steps, and one
   rank with accum 2 sees exactly the micro-batches of two ranks with accum 1.

A thread pool builds micro-batches ahead of the trainer (Zarr decompression releases the GIL).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from flashdraft.prompts import hash_fraction
from flashdraft.store import StoreReader
from flashdraft.vocab import frequent_tokens
from trainer.anchors import draw_anchors, stable_seed
from trainer.batch import Batch, collate

SORT_WINDOW = 64


def is_heldout(seq_id: str, fraction: float) -> bool:
    """Held-out part of a store for evaluation during training (salted apart from the prompt split)."""
    if fraction <= 0:
        return False
    return hash_fraction("trainer-heldout:" + seq_id) < fraction


def valid_anchor_counts(reader: StoreReader, block_size: int, max_length: int) -> np.ndarray:
    """Per sequence, how many anchors p <= S-B have loss_mask[p+1] (S truncated to max_length).

    From the shards' response-span index when the store has one (no array read), else from each shard's loss
    mask, read once (one byte a token)."""
    if reader.response_spans is None:
        return valid_anchor_counts_from_masks(reader, block_size, max_length)
    seq, start, end = reader.response_spans
    s = np.minimum(reader.lengths, max_length)[seq]
    lo = np.maximum(start, 1)  # mask index i = p + 1 for anchors p = 0 ..
    hi = np.minimum(end, s - block_size + 2)  # .. p = S-B (exclusive end)
    return np.bincount(seq, weights=np.maximum(hi - lo, 0), minlength=len(reader)).astype(np.int64)


def valid_anchor_counts_from_masks(reader: StoreReader, block_size: int, max_length: int) -> np.ndarray:
    """`valid_anchor_counts` from the stored loss masks: every shard's loss_mask array read once."""
    counts = np.zeros(len(reader), dtype=np.int64)
    start = 0
    for offsets, mask in reader.shard_loss_masks():
        n = len(offsets) - 1
        mask = mask.astype(np.int64)
        csum = np.concatenate([[0], np.cumsum(mask)])
        s = np.minimum(np.diff(offsets), max_length)
        lo = offsets[:-1] + 1  # loss_mask[p+1] for p = 0 ..
        hi = offsets[:-1] + s - block_size + 2  # .. p = S-B (exclusive end)
        counts[start : start + n] = np.where(s >= block_size, csum[np.maximum(hi, lo)] - csum[lo], 0)
        start += n
    return counts


@dataclass
class Plan:
    """One rank's micro-batches of an epoch: steps[t][a] is a list of global sequence indices."""

    steps: list
    num_microbatches: int
    skipped: int


class TrainingData:
    def __init__(
        self,
        paths,
        *,
        layer_ids,
        block_size: int,
        num_anchors: int,
        max_length: int,
        mask_token_id: int,
        gamma: float,
        seed: int = 0,
        heldout_fraction: float = 0.0,
        teacher: bool = False,
    ):
        paths = [paths] if isinstance(paths, str) else list(paths)
        if not paths:
            raise ValueError("no feature store given")
        self.readers = [StoreReader(p) for p in paths]
        self.teacher = teacher  # read the target's top-k next tokens and hand them to the batches (soft labels)
        missing = [str(r.path) for r in self.readers if teacher and not r.teacher_topk]
        if missing:
            raise ValueError(
                f"soft labels need the target's top-k in every store; {missing} hold none "
                f"(capture with data.store.teacher_topk=8)"
            )
        self.layer_ids = list(layer_ids)
        self.block_size, self.num_anchors, self.max_length = block_size, num_anchors, max_length
        self.mask_token_id, self.gamma, self.seed = mask_token_id, gamma, seed
        self.store_of = np.concatenate([np.full(len(r), k, dtype=np.int32) for k, r in enumerate(self.readers)])
        self.local = np.concatenate([np.arange(len(r)) for r in self.readers])
        self.seq_ids = [s for r in self.readers for s in r.seq_ids]
        self.lengths = np.minimum(np.concatenate([r.lengths for r in self.readers]), max_length)
        self.valid_anchors = np.concatenate([valid_anchor_counts(r, block_size, max_length) for r in self.readers])
        self.heldout = np.array([is_heldout(s, heldout_fraction) for s in self.seq_ids], dtype=bool)
        self.cost = self.lengths + np.minimum(self.valid_anchors, num_anchors) * block_size
        self.loss_vocab: np.ndarray | None = None  # sorted ids of a loss vocabulary: batches carry their loss words

    def __len__(self) -> int:
        return len(self.seq_ids)

    def thinking_modes(self) -> list[bool | None]:
        """Each training sequence's recorded chat-template thinking mode (None: not recorded); held-out ones left
        out."""
        modes = [m for r in self.readers for m in r.thinking]
        return [m for m, held in zip(modes, self.heldout) if not held]

    def plan(
        self,
        epoch: int,
        *,
        split: str = "train",
        token_budget: int,
        world_size: int = 1,
        rank: int = 0,
        grad_accum: int = 1,
    ) -> Plan:
        usable = (self.valid_anchors > 0) & (self.heldout if split == "heldout" else ~self.heldout)
        ids = np.flatnonzero(usable)
        skipped = int(((self.valid_anchors == 0) & (self.heldout if split == "heldout" else ~self.heldout)).sum())
        if len(ids) == 0:
            return Plan([], 0, skipped)
        rng = np.random.default_rng(stable_seed("plan", self.seed, epoch, split))
        ids = rng.permutation(ids)
        microbatches = []
        window = SORT_WINDOW * max(1, token_budget // max(int(np.median(self.cost[ids])), 1))
        for w in range(0, len(ids), window):
            chunk = ids[w : w + window]
            chunk = chunk[np.argsort(self.cost[chunk], kind="stable")]
            current, s_max, n_max = [], 0, 0
            for i in chunk:
                s, n = int(self.lengths[i]), min(int(self.valid_anchors[i]), self.num_anchors)
                s2, n2 = max(s_max, s), max(n_max, n)
                if current and (len(current) + 1) * (s2 + n2 * self.block_size) > token_budget:
                    microbatches.append(current)
                    current, s2, n2 = [], s, n
                current.append(int(i))
                s_max, n_max = s2, n2
            if current:
                microbatches.append(current)
        microbatches = [microbatches[k] for k in rng.permutation(len(microbatches))]
        per_step = world_size * grad_accum
        num_steps = -(-len(microbatches) // per_step)
        steps = [
            [microbatches[((t * grad_accum + a) * world_size + rank) % len(microbatches)] for a in range(grad_accum)]
            for t in range(num_steps)
        ]
        return Plan(steps, len(microbatches), skipped)

    def frequent_tokens(self, k: int, vocab_size: int) -> np.ndarray:
        """The k most frequent response tokens of the training split (ties to the lower id), sorted by id."""
        heldout = {s for s, h in zip(self.seq_ids, self.heldout) if h}
        sequences = (pair for reader in self.readers for pair in reader.token_sequences(skip=heldout))
        return frequent_tokens(sequences, k, vocab_size, max_length=self.max_length)

    def read(self, i: int):
        reader = self.readers[self.store_of[i]]
        # features stay in the stored precision (bf16: no conversion, half the bytes to pin and copy); the step
        # casts them to its own dtype on its device (`Batch.to`)
        seq = reader.read(int(self.local[i]), layers=self.layer_ids, teacher=self.teacher, upcast=False)
        if len(seq.input_ids) > self.max_length:
            m = self.max_length
            seq.input_ids, seq.loss_mask, seq.features = seq.input_ids[:m], seq.loss_mask[:m], seq.features[:m]
            if self.teacher:
                seq.teacher_ids, seq.teacher_logp = seq.teacher_ids[:m], seq.teacher_logp[:m]
        return seq

    def batch(self, indices, epoch: int) -> Batch:
        samples = []
        for i in indices:
            seq = self.read(i)
            anchors = draw_anchors(
                seq.loss_mask, self.block_size, self.num_anchors, seed=self.seed, epoch=epoch, seq_id=seq.seq_id
            )
            samples.append((seq, anchors))
        return collate(samples, self.block_size, self.mask_token_id, self.gamma, vocab=self.loss_vocab)


class Prefetcher:
    """Iterates micro-batches in order while `workers` threads build the next `depth` ahead.

    `wait_s` accumulates the time the consumer spent blocked on data."""

    def __init__(
        self,
        data: TrainingData,
        microbatches,
        epoch: int,
        *,
        workers: int = 2,
        depth: int = 4,
        pin_memory: bool = False,
    ):
        self.data, self.epoch, self.pin = data, epoch, pin_memory
        self.todo = iter(microbatches)
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="loader")
        self.queue = deque()
        self.depth = max(1, depth)
        self.wait_s = 0.0
        self._fill()

    def _build(self, indices) -> Batch:
        b = self.data.batch(indices, self.epoch)
        return b.pin_memory() if self.pin else b

    def _fill(self):
        while len(self.queue) < self.depth:
            nxt = next(self.todo, None)
            if nxt is None:
                return
            self.queue.append(self.pool.submit(self._build, nxt))

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if not self.queue:
            self.close()
            raise StopIteration
        t = time.perf_counter()
        batch = self.queue.popleft().result()
        self.wait_s += time.perf_counter() - t
        self._fill()
        return batch

    def close(self):
        for f in self.queue:
            f.cancel()
        self.queue.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)
