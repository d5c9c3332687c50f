"""The decayed block loss and its metrics.

Block j anchored at a_j has labels input_ids[a_j + k], k = 0..B-1. Output k = 0 is the anchor
itself and carries no loss; k >= 1 is weighted exp(-(k-1)/gamma), and zero where the label is not
a response token or lies past the end of the sequence. loss = sum(w * CE) / sum(w).

The logits (rows x vocabulary) are the big tensor here, so the cross entropy runs in chunks of
rows and only over rows with weight > 0, and its gradient with respect to the hidden states is
formed chunk by chunk in the forward pass: peak memory is one chunk of logits, not all of them.

Soft labels (`soft`): the label of a row becomes the distribution (1 - a) * onehot(label) + a * p,
p the target's top-k next-token probabilities there, renormalised over the k; CE against it (a = 0:
the paper's loss). With greedy responses the label is p's top token, so a moves mass from the one
token to the target's runners-up.

A loss vocabulary (`vocab`, sorted token ids) restricts the softmax to those tokens plus every label
and teacher token of the batch, as EAGLE-3 and FR-Spec restrict a draft vocabulary: a target's
responses use few of its words, and the head's matmuls and log-softmax shrink with the columns. The head
itself stays whole; drafting still scores all words.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def default_gamma(block_size: int) -> float:
    """Loss decay of the paper: 7 for B=16, 5 for B=10, 4 for B=8 (linear in between)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 7.0 - (16 - block_size) / 3.0) if block_size > 8 else max(1.0, block_size / 2.0)


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """[B] weights: 0 at k = 0, exp(-(k-1)/gamma) for k >= 1."""
    k = np.arange(block_size, dtype=np.float64)
    w = np.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.astype(np.float32)


def block_labels(input_ids: np.ndarray, loss_mask: np.ndarray, anchors: np.ndarray, block_size: int, gamma: float):
    """Labels [N, B] (0 where invalid) and weights [N, B] for one sequence's anchors [N]."""
    pos = anchors[:, None] + np.arange(block_size)[None, :]
    inside = pos < len(input_ids)
    clipped = np.minimum(pos, len(input_ids) - 1)
    valid = inside & np.asarray(loss_mask, dtype=bool)[clipped]
    labels = np.where(valid, np.asarray(input_ids)[clipped], 0).astype(np.int64)
    weights = np.where(valid, position_weights(block_size, gamma)[None, :], 0.0).astype(np.float32)
    return labels, weights


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ head.T, target_i), gradient for `hidden` only (the head is frozen).

    target_i is onehot(label_i), or with soft = (ids [n, k], probs [n, k], a) the mix described above."""

    @staticmethod
    def forward(ctx, hidden, head, labels, w, chunk, soft=None):
        need_grad = ctx.needs_input_grad[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        preds = torch.empty(len(hidden), dtype=torch.long, device=hidden.device)
        grad = torch.empty_like(hidden) if need_grad else None
        hard = 1.0 - soft[2] if soft else 1.0  # the one-hot label's share of the target
        t_ids_all, t_p_all = (soft[0], soft[1] * soft[2]) if soft else (None, None)
        for i in range(0, len(hidden), chunk):
            h, y, wi = hidden[i : i + chunk], labels[i : i + chunk], w[i : i + chunk]
            logits = h @ head.T
            preds[i : i + chunk] = logits.max(dim=-1).indices  # the first index on ties, as argmax, and faster on CPU
            logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # one fused pass, fp32 out
            row_ll = logp.gather(1, y[:, None])[:, 0] * hard
            if soft:
                t_ids, t_p = t_ids_all[i : i + chunk], t_p_all[i : i + chunk]
                row_ll = row_ll + (logp.gather(1, t_ids) * t_p).sum(1)
            loss -= (row_ll * wi).sum()
            if need_grad:
                p = logp.exp_()
                p[torch.arange(len(y), device=p.device), y] -= hard
                if soft:
                    p.scatter_add_(1, t_ids, -t_p)
                p.mul_(wi[:, None])
                grad[i : i + chunk] = (p.to(head.dtype) @ head).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(preds)
        return loss, preds

    @staticmethod
    def backward(ctx, grad_loss, grad_preds):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def leading_matches(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per block ([blocks, B] bools, position 0 the anchor): how many positions k = 1.. in a row have a valid
    label predicted right, the drafts a greedy verification would accept."""
    return (correct[:, 1:] & valid[:, 1:]).int().cumprod(dim=1).sum(dim=1)


def loss_rows(weights: np.ndarray) -> np.ndarray:
    """The rows [b * N * B] of a batch with a loss weight, flattened and in order: the rows `block_loss` scores. Counted
    on the host when the batch is built, so that selecting them waits for nothing on the device."""
    return np.flatnonzero(np.asarray(weights).reshape(-1) > 0)


def loss_words(vocab: np.ndarray, labels: np.ndarray, weights: np.ndarray, teacher_ids=None) -> np.ndarray:
    """The words of a batch's training softmax under a loss vocabulary (sorted ids): `vocab` and every label and
    teacher token of the rows with a loss weight, sorted (what `block_loss` computes from `vocab` on the device)."""
    rows = loss_rows(weights)
    parts = [np.asarray(vocab), np.asarray(labels).reshape(-1)[rows]]
    if teacher_ids is not None:
        teacher_ids = np.asarray(teacher_ids)
        parts.append(teacher_ids.reshape(-1, teacher_ids.shape[-1])[rows].ravel())
    return np.unique(np.concatenate(parts).astype(np.int64))


def block_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    block_size: int,
    chunk: int = 1024,
    soft: tuple | None = None,
    vocab: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    words: torch.Tensor | None = None,
):
    """hidden [b, N*B, H], labels/weights [b, N*B] -> (loss, stats).

    soft: None, or (teacher ids [b, N*B, k], teacher probs [b, N*B, k], weight a in (0, 1]).
    vocab: None (the softmax over all words), or sorted ids: the softmax over them and the batch's labels
    and teacher tokens (predictions, and so the stats, then come from those words only).
    rows, words: the batch's `loss_rows` and (with a vocab) `loss_words`, counted on the host; None: found here,
    which on a GPU waits for the device to count them (a data-dependent shape).

    stats (detached sums, so ranks and steps can be summed before dividing): `weight` sum(w),
    `pos_correct`/`pos_total` [B] per-position hits and valid labels (k >= 1), `accept` sum over
    blocks of 1 + the number of leading positions k = 1.. predicted right, `blocks` block count.
    """
    flat_w = weights.reshape(-1)
    weighted = flat_w > 0
    if rows is None:
        rows = weighted.nonzero()[:, 0]
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    y = labels.reshape(-1).index_select(0, rows)
    total_w = weights.sum()
    w = flat_w.index_select(0, rows).float() / total_w.clamp_min(1e-12)
    if soft is not None:
        k = soft[0].shape[-1]
        t_ids, t_probs = soft[0].reshape(-1, k).index_select(0, rows), soft[1].reshape(-1, k).index_select(0, rows)
        soft = (t_ids, t_probs.float(), float(soft[2]))
    if vocab is not None and words is None:
        words = torch.unique(torch.cat([vocab, y] + ([soft[0].reshape(-1)] if soft is not None else [])))
    if words is not None:
        head_weight = head_weight.index_select(0, words)
        y_all, y = y, torch.searchsorted(words, y)
        if soft is not None:
            soft = (torch.searchsorted(words, soft[0]), soft[1], soft[2])
    loss, preds = _ChunkedLinearCE.apply(h, head_weight, y, w, chunk, soft)
    if words is not None:
        preds, y = words[preds], y_all

    correct = torch.zeros(weights.numel(), dtype=torch.bool, device=hidden.device).scatter_(0, rows, preds == y)
    correct = correct.view(-1, block_size)  # [blocks, B]
    valid = weighted.view(-1, block_size)
    real = valid.any(dim=1)  # padded blocks (and blocks with no valid label) are not counted
    leading = leading_matches(correct, valid)
    stats = {
        "weight": total_w.detach().float(),
        "pos_correct": correct.sum(0).float(),
        "pos_total": valid.sum(0).float(),
        "accept": ((1 + leading) * real).sum().float(),
        "blocks": real.sum().float(),
    }
    return loss, stats


def summarize(stats: dict, loss_sum: float, count: int) -> dict:
    """Turn summed stats (tensors, or the host's lists and floats) into logged metrics: loss, acc (k >= 1), acc_k,
    tau."""
    pos_c, pos_t = (_host(stats["pos_correct"]), _host(stats["pos_total"]))
    out = {"loss": loss_sum / max(count, 1)}
    out["acc"] = sum(pos_c[1:]) / max(sum(pos_t[1:]), 1.0)
    for k in range(1, len(pos_c)):
        out[f"acc_{k}"] = pos_c[k] / pos_t[k] if pos_t[k] else math.nan
    out["tau"] = float(stats["accept"]) / max(float(stats["blocks"]), 1.0)
    return out


def _host(values) -> list[float]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
