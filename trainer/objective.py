"""The training forward: frozen embedding -> drafter over [context | blocks] -> decayed loss."""

from __future__ import annotations

import torch

from trainer.batch import Batch
from trainer.loss import block_loss, leading_matches
from trainer.masks import dense_block_mask, flex_block_mask


def attention_mask(batch: Batch, block_size: int, kind: str):
    """kind: "dense" (bool mask for SDPA; needed for backward on CPU) or "flex" (BlockMask)."""
    if kind == "dense":
        return dense_block_mask(batch.anchors, batch.context_len, block_size)
    if kind == "flex":
        return flex_block_mask(batch.anchors, batch.context_len, block_size, compile=batch.anchors.is_cuda)
    raise ValueError(f"attention must be 'dense' or 'flex', got {kind!r}")


def draft_hidden(drafter, head, batch: Batch, mask) -> torch.Tensor:
    with torch.no_grad():
        noise = head.embed_tokens(batch.block_ids)
    return drafter(noise, batch.context, batch.position_ids, attention_mask=mask)


def accepted_lengths(drafter, head, batch: Batch, *, block_size: int, attention: str = "dense", chunk: int = 1024) -> torch.Tensor:
    """[b, N]: per block, how many leading drafts (k = 1..) equal their labels, each the argmax over all words:
    what a greedy verification of that block would accept. No gradient."""
    with torch.no_grad():
        hidden = draft_hidden(drafter, head, batch, attention_mask(batch, block_size, attention))
        b, h = hidden.shape[0], hidden.shape[-1]
        rows = hidden.view(b, -1, block_size, h)[:, :, 1:].reshape(-1, h)  # the anchor's own output predicts nothing
        preds = torch.cat([(rows[i : i + chunk] @ head.lm_head.weight.T).max(dim=-1).indices for i in range(0, len(rows), chunk)])
        labels = batch.labels.view(-1, block_size)
        correct = torch.zeros_like(labels, dtype=torch.bool)
        correct[:, 1:] = preds.view(-1, block_size - 1) == labels[:, 1:]
        return leading_matches(correct, batch.weights.view(-1, block_size) > 0).view(b, -1)


def forward_loss(drafter, head, batch: Batch, *, block_size: int, attention: str = "dense", ce_chunk: int = 1024,
                 soft_labels: float = 0.0, vocab: torch.Tensor | None = None):  # fmt: skip
    """(loss, stats) for one micro-batch already on the drafter's device; soft_labels > 0 mixes the
    target's top-k distribution into the labels (the batch must carry it); vocab: the loss vocabulary
    (`block_loss`)."""
    hidden = draft_hidden(drafter, head, batch, attention_mask(batch, block_size, attention))
    soft = None
    if soft_labels > 0:
        if batch.teacher_ids is None:
            raise ValueError("soft_labels > 0 needs feature stores captured with data.store.teacher_topk > 0")
        soft = (batch.teacher_ids, batch.teacher_probs, soft_labels)
    return block_loss(hidden, head.lm_head.weight, batch.labels, batch.weights, block_size, chunk=ce_chunk, soft=soft,
                      vocab=vocab)
