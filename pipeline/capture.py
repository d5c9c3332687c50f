"""Regenerate responses with the target and capture its hidden states in the same pass.

`regenerate` is a batched decode loop over a left-padded batch with a DynamicCache and
`output_hidden_states=True`: the prefill yields the prompt tokens' states, each decode step yields
the state of the token it consumes. After the last generated token one more (cheap, one-token)
step runs so that every stored position, the last one included, holds the target's real state;
the features of a sequence therefore equal a fresh full forward over its tokens.

`capture` is the capture-only mode for data that already has responses: one prefill per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from flashdraft.model import extract_context_feature
from flashdraft.sampling import sample, sampling_probs


class TargetNaNError(RuntimeError):
    """The target produced NaN/Inf hidden states."""


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class Captured:
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]
    features: torch.Tensor  # [S, n*H], the target's dtype, on CPU
    finished: bool  # ended with a stop token (False: hit the length limit)


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


def pick_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    if not sampling.do_sample or sampling.temperature <= 0:
        return logits.argmax(-1)
    return sample(sampling_probs(logits, sampling.temperature, sampling.top_p, sampling.top_k), generator)


def _check_finite(feats: torch.Tensor, what: str) -> None:
    if not torch.isfinite(feats).all():
        raise TargetNaNError(f"the target emitted NaN/Inf hidden states for {what}")


@torch.no_grad()
def regenerate(
    model,
    prompts: list[list[int]],
    layer_ids: list[int],
    *,
    max_new_tokens: int | list[int],
    stop_ids: list[int],
    pad_id: int,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
) -> list[Captured]:
    """Generate a response per prompt (batched) and return prompt+response with their features.

    `max_new_tokens` may be per prompt. The response includes its stop token.
    """
    device = next(model.parameters()).device
    b = len(prompts)
    limits = torch.as_tensor([max_new_tokens] * b if isinstance(max_new_tokens, int) else max_new_tokens, device=device)
    if (limits < 1).any():
        raise ValueError(f"max_new_tokens must be >= 1 for every prompt, got {limits.tolist()}")
    stops = torch.as_tensor(stop_ids or [-1], device=device)
    ids, mask, pos = left_pad(prompts, pad_id, device)
    cache = DynamicCache(config=model.config)
    step = dict(cache=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **step)
    prompt_feats = extract_context_feature(out.hidden_states, layer_ids)
    next_pos = pos[:, -1] + 1
    generated, step_feats = [], []
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    for t in range(int(limits.max())):
        tok = torch.where(done, torch.full_like(lengths, pad_id), pick_tokens(out.logits[:, -1], sampling, generator))
        generated.append(tok)
        lengths = torch.where(done, lengths, lengths + 1)
        hit_stop = torch.isin(tok, stops) & ~done
        finished |= hit_stop
        done |= hit_stop | (lengths >= limits)
        # This step's forward computes the state of `tok` (needed) and the next logits (needed unless done).
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None], **step)
        step_feats.append(extract_context_feature(out.hidden_states, layer_ids))
        next_pos = next_pos + 1
        if bool(done.all()):  # one host sync per step, as generate() does
            break
    gen = torch.stack(generated, 1).cpu()
    gen_feats = torch.cat(step_feats, 1).cpu()
    prompt_feats, lengths, finished = prompt_feats.cpu(), lengths.cpu(), finished.cpu()
    width = prompt_feats.shape[1]
    results = []
    for r, p in enumerate(prompts):
        n = int(lengths[r])
        feats = torch.cat([prompt_feats[r, width - len(p) :], gen_feats[r, :n]])
        _check_finite(feats, f"prompt {r} of the batch")
        tokens = torch.cat([torch.as_tensor(p, dtype=torch.long), gen[r, :n]])
        loss_mask = torch.arange(len(tokens)) >= len(p)
        results.append(Captured(tokens, loss_mask, feats, bool(finished[r])))
    return results


@torch.no_grad()
def capture(model, sequences: list[list[int]], loss_masks: list, layer_ids: list[int], *, pad_id: int) -> list[Captured]:
    """Capture-only: one left-padded prefill over complete sequences (prompt + existing response)."""
    device = next(model.parameters()).device
    ids, mask, pos = left_pad(sequences, pad_id, device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    feats = extract_context_feature(out.hidden_states, layer_ids).cpu()
    width = feats.shape[1]
    results = []
    for r, (s, m) in enumerate(zip(sequences, loss_masks)):
        f = feats[r, width - len(s) :]
        _check_finite(f, f"sequence {r} of the batch")
        results.append(Captured(torch.as_tensor(s, dtype=torch.long), torch.as_tensor(m, dtype=torch.bool), f, True))
    return results
