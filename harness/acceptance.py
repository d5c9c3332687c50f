"""Which drafts the target accepts: greedy acceptance, speculative rejection sampling (Leviathan et al. 2023,
Chen et al. 2023, which keeps the target's distribution exactly whatever the drafter proposes) and the greedy
walk of a tree; `Sampling` says how a token is chosen from logits (flashdraft.sampling's distribution)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.sampling import check_sampling, sample, sampling_probs
from harness.tree import greedy_path


@dataclass(frozen=True)
class Sampling:
    """Greedy at temperature 0, else samples from the filtered distribution with `generator`."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, self.temperature, self.top_p, self.top_k)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of `logits`: the argmax, or a draw from the filtered distribution."""
        return logits.argmax(dim=-1) if self.greedy else sample(self.probs(logits), self.generator)


GREEDY = Sampling()


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


def accept(draft, target_logits: torch.Tensor, sampling: Sampling) -> tuple[list[int], torch.Tensor]:
    """(rows of `draft` (a `harness.policies.Draft`) the target accepts, the token it emits after them), from the
    verify forward's logits [rows, V]: the tree's greedy walk, greedy acceptance, or rejection sampling."""
    if draft.tree is not None:
        return greedy_path(draft.tree, target_logits)
    drafts = draft.tokens[0, 1:]
    if sampling.greedy:
        accepted, token = greedy_accept(drafts, target_logits)
    elif drafts.numel():
        accepted, token = rejection_sample(drafts, sampling.probs(target_logits), draft.draft_probs, sampling.generator)
    else:
        accepted, token = 0, sample(sampling.probs(target_logits)[-1], sampling.generator)
    return list(range(1, accepted + 1)), token
