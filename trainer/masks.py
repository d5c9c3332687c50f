"""The training attention mask over [S context | N blocks of B].

A query in block j sees the context positions strictly before its anchor a_j and every position of
its own block (not causal inside the block), nothing of other blocks. Rows of a batch are padded:
padded context positions lie past the last anchor of the row (anchors are <= S_row - B), so no
block sees them; padded blocks carry anchor 0, see no context and only themselves, so every query
row has a visible key and SDPA never produces NaN.

The same predicate backs the dense boolean mask (SDPA; training on CPU) and the FlexAttention
BlockMask (block-sparse kernels on GPU).
"""

from __future__ import annotations

import torch

try:
    from torch.nn.attention.flex_attention import create_block_mask
except ImportError:  # pragma: no cover
    create_block_mask = None


def _visible(anchors: torch.Tensor, b, q_idx, kv_idx, context_len: int, block_size: int):
    block = q_idx // block_size
    sees_context = (kv_idx < context_len) & (kv_idx < anchors[b, block])
    own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
    return sees_context | own_block


def dense_block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [b, 1, N*B, context_len + N*B] (True = visible) for anchors [b, N]."""
    b, n = anchors.shape
    q = n * block_size
    rows = torch.arange(b, device=anchors.device)[:, None, None]
    q_idx = torch.arange(q, device=anchors.device)[None, :, None]
    kv_idx = torch.arange(context_len + q, device=anchors.device)[None, None, :]
    return _visible(anchors, rows, q_idx, kv_idx, context_len, block_size)[:, None]


def flex_block_mask(anchors: torch.Tensor, context_len: int, block_size: int, compile: bool = False):
    """FlexAttention BlockMask with the same visibility as `dense_block_mask`."""
    if create_block_mask is None:
        raise RuntimeError("this torch has no FlexAttention; use the dense mask")
    b, n = anchors.shape
    q = n * block_size

    def mask_mod(bi, h, q_idx, kv_idx):
        return _visible(anchors, bi, q_idx, kv_idx, context_len, block_size)

    return create_block_mask(mask_mod, b, None, q, context_len + q, device=anchors.device, _compile=compile)
