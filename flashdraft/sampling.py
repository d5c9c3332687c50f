"""The target's sampling distribution: temperature, then top-k, then top-p (nucleus) filtering.

One definition shared by the pipeline (regenerating responses) and the harness (speculative and
plain decoding), so that both sample from exactly the same distribution."""

from __future__ import annotations

import torch


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Probabilities over the vocabulary after temperature, top-k, then top-p (nucleus) filtering.

    top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p (the token
    that crosses the threshold is kept), as transformers' TopPLogitsWarper does."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
