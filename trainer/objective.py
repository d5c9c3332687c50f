"""The training forward: frozen embedding -> drafter over [context | blocks] -> decayed loss."""

from __future__ import annotations

import torch

from trainer.batch import Batch
from trainer.loss import block_loss
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


def forward_loss(drafter, head, batch: Batch, *, block_size: int, attention: str = "dense", ce_chunk: int = 1024):
    """(loss, stats) for one micro-batch already on the drafter's device."""
    hidden = draft_hidden(drafter, head, batch, attention_mask(batch, block_size, attention))
    return block_loss(hidden, head.lm_head.weight, batch.labels, batch.weights, block_size, chunk=ce_chunk)
