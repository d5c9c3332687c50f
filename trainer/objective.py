"""The training forward: frozen embedding -> drafter over [context | blocks] -> decayed loss."""

from __future__ import annotations

import torch

from trainer.batch import Batch
from trainer.loss import block_loss
from trainer.masks import dense_block_mask, flex_block_mask


def attention_mask(batch: Batch, block_size: int, kind: str, compile_mask: bool | None = None):
    """kind: "dense" (bool mask for SDPA; needed for backward on CPU) or "flex" (BlockMask, made by a compiled
    `create_block_mask` where `compile_mask`; None: on CUDA, where the eager one is slow at training sizes)."""
    if kind == "dense":
        return dense_block_mask(batch.anchors, batch.context_len, block_size)
    if kind == "flex":
        compile_mask = batch.anchors.is_cuda if compile_mask is None else compile_mask
        return flex_block_mask(batch.anchors, batch.context_len, block_size, compile=compile_mask)
    raise ValueError(f"attention must be 'dense' or 'flex', got {kind!r}")


def draft_hidden(drafter, head, batch: Batch, mask) -> torch.Tensor:
    with torch.no_grad():
        noise = head.embed_tokens(batch.block_ids)
    return drafter(noise, batch.context, batch.position_ids, attention_mask=mask)


def forward_loss(
    drafter,
    head,
    batch: Batch,
    *,
    block_size: int,
    attention: str = "dense",
    ce_chunk: int = 1024,
    soft_labels: float = 0.0,
    vocab: torch.Tensor | None = None,
    compile_mask: bool | None = None,
):
    """(loss, stats) for one micro-batch already on the drafter's device; soft_labels > 0 mixes the
    target's top-k distribution into the labels (the batch must carry it); vocab: the loss vocabulary
    (`block_loss`; the batch's own `loss_words` where it carries them)."""
    hidden = draft_hidden(drafter, head, batch, attention_mask(batch, block_size, attention, compile_mask))
    soft = None
    if soft_labels > 0:
        if batch.teacher_ids is None:
            raise ValueError("soft_labels > 0 needs feature stores captured with data.store.teacher_topk > 0")
        soft = (batch.teacher_ids, batch.teacher_probs, soft_labels)
    words = batch.loss_words if vocab is not None else None
    return block_loss(
        hidden,
        head.lm_head.weight,
        batch.labels,
        batch.weights,
        block_size,
        chunk=ce_chunk,
        soft=soft,
        vocab=vocab,
        rows=batch.loss_rows,
        words=words,
    )
