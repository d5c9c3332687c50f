"""The target's hidden states, tapped at the chosen layers, as `Captured` sequences; the small pieces every capture
path shares.

`capture` is the capture-only mode for data that already has responses: one left-padded prefill per batch, with
forward hooks on the chosen decoder layers (`LayerTap`: only those layers' outputs are kept, not every hidden state).
Regeneration (a response decoded and captured in the same pass) builds on these pieces: `pipeline.decode`.

With `teacher_topk=k` it also keeps, per token, the target's k most likely next tokens and their log-probabilities
(soft labels for the trainer), from the final hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.config import SamplingConfig
from flashdraft.sampling import sample, sampling_probs
from flashdraft.target.capture import LayerTap


class TargetNaNError(RuntimeError):
    """The target produced NaN/Inf hidden states."""


@dataclass
class Captured:
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]
    features: torch.Tensor  # [S, n*H], the target's dtype, on CPU
    finished: bool  # ended with a stop token (False: hit the length limit)
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids int64 [S, k], log-probs float32 [S, k])


def next_token_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] logits -> (ids, log-probs) [..., k] of the k most likely next tokens, on the CPU."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(k, dim=-1)
    return top.indices.cpu(), top.values.cpu()


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) with pads on the left and positions that skip them."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
        mask[r, width - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


def pick_tokens(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    if not sampling.do_sample or sampling.temperature <= 0:
        return logits.argmax(-1)
    return sample(sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k), generator)


def check_finite(feats: torch.Tensor, what: str) -> None:
    if not torch.isfinite(feats).all():
        raise TargetNaNError(f"the target emitted NaN/Inf hidden states for {what}")


def token_batches(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Consecutive indices of `lengths` grouped so that rows x longest row <= `budget` (the tokens of a left-padded
    batch); a sequence longer than the budget goes alone. Sorted lengths pad least. None: one group."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and budget is not None and (len(groups[-1]) + 1) * max(longest, n) > budget:
            groups.append([])
            longest = 0
        if not groups:
            groups.append([])
        groups[-1].append(i)
        longest = max(longest, n)
    return groups


@torch.no_grad()
def capture(
    model,
    sequences: list[list[int]],
    loss_masks: list,
    layer_ids: list[int],
    *,
    pad_id: int,
    teacher_topk: int = 0,
    project=None,
) -> list[Captured]:
    """Capture-only: one left-padded prefill over complete sequences (prompt + existing response). `project`: a
    store's basis, applied on the device (`LayerTap`)."""
    device = next(model.parameters()).device
    ids, mask, pos = left_pad(sequences, pad_id, device)
    with LayerTap(model, layer_ids, final=bool(teacher_topk), project=project) as tap:
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
        feats, final = tap.features().cpu(), tap.final
    width = feats.shape[1]
    head = model.get_output_embeddings()
    results = []
    for r, (s, m) in enumerate(zip(sequences, loss_masks)):
        f = feats[r, width - len(s) :]
        check_finite(f, f"sequence {r} of the batch")
        # `final` is the final-normed state the head reads; one row at a time keeps [S, V] logits small
        top = next_token_topk(head(final[r, width - len(s) :]), teacher_topk) if teacher_topk else None
        results.append(
            Captured(torch.as_tensor(s, dtype=torch.long), torch.as_tensor(m, dtype=torch.bool), f, True, top)
        )
    return results
