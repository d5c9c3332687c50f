"""Token choice for speculative decoding: the filtered sampling distribution, greedy acceptance and
speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023), which keeps the target's
distribution exactly whatever the drafter proposes."""

from __future__ import annotations

import torch

from flashdraft.sampling import sample


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """draft_tokens [k], target_logits [k+1, V] (row i predicts the token after block position i).

    Returns (accepted, next_token): the length of the leading run of drafts equal to the target's
    argmax, and the target's argmax right after that run (the correction or the bonus)."""
    posterior = target_logits.argmax(dim=-1)
    accepted = int((draft_tokens == posterior[:-1]).cumprod(dim=0).sum())
    return accepted, posterior[accepted]


def rejection_sample(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, torch.Tensor]:
    """draft_tokens [k] drawn from draft_probs [k, V]; target_probs [k+1, V].

    Draft i is accepted with probability min(1, p(x)/q(x)); at the first rejection the token is
    drawn from norm(max(0, p - q)); if all k are accepted the bonus is drawn from p at position k.
    The committed tokens are then distributed exactly as the target samples them."""
    k = draft_tokens.shape[0]
    p = target_probs[:k].gather(-1, draft_tokens[:, None])[:, 0]
    q = draft_probs.gather(-1, draft_tokens[:, None])[:, 0]
    u = torch.rand(k, generator=generator, device=q.device, dtype=q.dtype)
    accepted = int((u * q < p).int().cumprod(dim=0).sum())  # u < p/q without dividing by q
    if accepted == k:
        return k, sample(target_probs[k], generator)
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    # residual == 0 only when p == q, where rejection has probability 0; fall back to p.
    residual = residual / total if total > 0 else target_probs[accepted]
    return accepted, sample(residual, generator)
