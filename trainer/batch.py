"""One training micro-batch: sequences padded into rows, with their anchored blocks.

Row r holds one sequence: its context features padded to the longest context of the batch, then
its blocks padded to the largest anchor count of the batch (padded blocks: anchor 0, weight 0).
Padding, not packing several sequences into one row: the dense CPU mask costs rows x Q x KV, so
packed rows would pay quadratically for attention between sequences that never see each other,
and the loader sorts sequences by length so the padding stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from trainer.loss import block_labels, loss_rows, loss_words


@dataclass
class Batch:
    context: torch.Tensor  # [b, S, n*H] target features
    block_ids: torch.Tensor  # [b, N*B] anchor token then mask tokens
    position_ids: torch.Tensor  # [b, S + N*B] context 0..S-1, block j a_j..a_j+B-1
    anchors: torch.Tensor  # [b, N] (0 on padded blocks)
    labels: torch.Tensor  # [b, N*B]
    weights: torch.Tensor  # [b, N*B]
    tokens: int  # real context tokens
    seq_ids: list
    teacher_ids: torch.Tensor | None = None  # [b, N*B, k] the target's top-k tokens for each label (soft labels)
    teacher_probs: torch.Tensor | None = None  # [b, N*B, k] their probabilities, renormalised over the k
    # the flattened rows with a loss weight [n] (`trainer.loss.loss_rows`) and, under a loss vocabulary, the words of
    # the training softmax (`loss_words`): counted here, on the host, so the loss waits for nothing on the device
    loss_rows: torch.Tensor | None = None
    loss_words: torch.Tensor | None = None

    @property
    def context_len(self) -> int:
        return self.context.shape[1]

    def to(self, device, dtype=None) -> Batch:
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v.to(device, non_blocking=True)
                if dtype is not None and v.is_floating_point() and f.name == "context":
                    v = v.to(dtype)
            moved[f.name] = v
        return Batch(**moved)

    def pin_memory(self) -> Batch:
        return Batch(
            **{
                f.name: (v.pin_memory() if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                for f in fields(self)
            }
        )


def collate(samples, block_size: int, mask_token_id: int, gamma: float, vocab: np.ndarray | None = None) -> Batch:
    """samples: (StoredSequence, anchors np.int64 [N]) pairs, every N >= 1; vocab: the loss vocabulary (sorted ids),
    whose `loss_words` the batch then carries."""
    b = len(samples)
    s_max = max(len(seq.input_ids) for seq, _ in samples)
    n_max = max(len(a) for _, a in samples)
    width = samples[0][0].features.shape[1]
    context = torch.zeros(b, s_max, width, dtype=samples[0][0].features.dtype)
    anchors = np.zeros((b, n_max), dtype=np.int64)
    labels = np.zeros((b, n_max, block_size), dtype=np.int64)
    weights = np.zeros((b, n_max, block_size), dtype=np.float32)
    block_ids = np.full((b, n_max, block_size), mask_token_id, dtype=np.int64)
    soft = getattr(samples[0][0], "teacher_ids", None) is not None
    if soft:
        k = samples[0][0].teacher_ids.shape[1]
        t_ids, t_probs = (
            np.zeros((b, n_max, block_size, k), dtype=np.int64),
            np.zeros((b, n_max, block_size, k), dtype=np.float32),
        )
    for r, (seq, a) in enumerate(samples):
        s, n = len(seq.input_ids), len(a)
        if soft:  # label a + j is predicted after token a + j - 1: that row holds the target's top-k for it
            rows = np.clip(a[:, None] + np.arange(block_size)[None, :] - 1, 0, s - 1)
            t_ids[r, :n] = seq.teacher_ids[rows]
            t_probs[r, :n] = _softmax(seq.teacher_logp[rows])
        context[r, :s] = seq.features
        anchors[r, :n] = a
        labels[r, :n], weights[r, :n] = block_labels(seq.input_ids, seq.loss_mask, a, block_size, gamma)
        block_ids[r, :n, 0] = seq.input_ids[a]
    teacher = t_ids if soft else None
    block_pos = anchors[:, :, None] + np.arange(block_size)[None, None, :]
    position_ids = np.concatenate([np.broadcast_to(np.arange(s_max), (b, s_max)), block_pos.reshape(b, -1)], axis=1)
    return Batch(
        context=context,
        block_ids=torch.from_numpy(block_ids.reshape(b, -1)),
        position_ids=torch.from_numpy(np.ascontiguousarray(position_ids)),
        anchors=torch.from_numpy(anchors),
        labels=torch.from_numpy(labels.reshape(b, -1)),
        weights=torch.from_numpy(weights.reshape(b, -1)),
        tokens=sum(len(seq.input_ids) for seq, _ in samples),
        seq_ids=[seq.seq_id for seq, _ in samples],
        teacher_ids=torch.from_numpy(t_ids.reshape(b, n_max * block_size, -1)) if soft else None,
        teacher_probs=torch.from_numpy(t_probs.reshape(b, n_max * block_size, -1)) if soft else None,
        loss_rows=torch.from_numpy(loss_rows(weights)),
        loss_words=None if vocab is None else torch.from_numpy(loss_words(vocab, labels, weights, teacher)),
    )


def _softmax(logp: np.ndarray) -> np.ndarray:
    """Renormalise top-k log-probs over the k; rows never captured (-inf) come out uniform (they carry no weight)."""
    x = np.where(np.isfinite(logp), logp, -1e4)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
