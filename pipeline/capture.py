"""Regenerate responses with the target and capture its hidden states in the same pass.

`regenerate` is a batched decode loop over a left-padded batch with a DynamicCache, with forward hooks on the
chosen decoder layers (`LayerTap`: only those layers' outputs are kept, not every hidden state): the prefill
yields the prompt tokens' states, each decode step yields the state of the token it consumes. After the last
generated token one more (cheap, one-token) step runs so that every stored position, the last one included,
holds the target's real state; the features of a sequence therefore equal a fresh full forward over its tokens.
`regenerate_stream` hands each sequence over the step it ends, so a caller that writes it out holds only the
sequences still decoding.

`capture` is the capture-only mode for data that already has responses: one prefill per batch.

With `teacher_topk=k` both also keep, per token, the target's k most likely next tokens and their
log-probabilities (soft labels for the trainer): in `regenerate` from the logits each step computes
anyway, so from the last prompt token on; in `capture` for every token, from the final hidden states.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from flashdraft.config import SamplingConfig
from flashdraft.sampling import sample, sampling_probs
from flashdraft.target.capture import LayerTap
from flashdraft.target.memory import CACHE_HEADROOM


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


def _check_finite(feats: torch.Tensor, what: str) -> None:
    if not torch.isfinite(feats).all():
        raise TargetNaNError(f"the target emitted NaN/Inf hidden states for {what}")


@torch.no_grad()
def regenerate(model, prompts: list[list[int]], layer_ids: list[int], **options) -> list[Captured]:
    """Generate a response per prompt and return prompt+response with their features, in prompt order:
    `regenerate_stream` with the same arguments (`options`: its keyword arguments), collected.

    Continuous batching: at most `batch_size` sequences (default: all of them) decode together; a
    sequence leaves the batch the step it ends, and waiting prompts take the free rows (prefilled
    together, then merged into the batch's cache, left-padded to a common width), so no step is spent
    on finished rows. `max_new_tokens` may be per prompt. The response includes its stop token. `sampling`:
    None is greedy.
    """
    results = [None] * len(prompts)
    for i, captured in regenerate_stream(model, prompts, layer_ids, **options):
        results[i] = captured
    return results


def regenerate_stream(
    model,
    prompts: list[list[int]],
    layer_ids: list[int],
    *,
    max_new_tokens: int | list[int],
    stop_ids: list[int],
    pad_id: int,
    sampling: SamplingConfig | None = None,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
    teacher_topk: int = 0,
    prefill_tokens: int | None = None,
):
    """`regenerate` as a generator of (prompt index, Captured), each yielded the step its sequence ends; nothing
    is kept once yielded, so the caller's memory stays bounded by the batch, not by the number of prompts.
    `prefill_tokens`: the prompts joining the batch are prefilled in groups of at most this many tokens, padding
    included (`token_batches`); None: all together."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts) or any(n < 1 for n in limits):
        raise ValueError(f"max_new_tokens must be >= 1 for every prompt, got {limits}")
    sampling = sampling or SamplingConfig()
    decode = _ContinuousDecode(model, prompts, layer_ids, limits, stop_ids, pad_id, sampling, generator, teacher_topk)
    yield from decode.run(batch_size or max(1, len(prompts)), prefill_tokens)


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


class _ContinuousDecode:
    """The state of `regenerate`: the batch's rows (prompt indices) with their cache, attention mask, positions,
    next tokens, response lengths and end flags, and per prompt the tokens, features and teacher rows so far."""

    def __init__(self, model, prompts, layer_ids, limits, stop_ids, pad_id, sampling, generator, teacher_topk):
        self.model, self.prompts, self.layer_ids, self.limits = model, prompts, layer_ids, limits
        self.pad_id, self.sampling, self.generator, self.teacher_topk = pad_id, sampling, generator, teacher_topk
        self.device = next(model.parameters()).device
        self.stops = torch.as_tensor(stop_ids or [-1], device=self.device)
        self.step_kwargs = dict(use_cache=True, logits_to_keep=1)
        self.waiting = deque(range(len(prompts)))
        self.rows: list[int] = []  # prompt index of each batch row
        self.cache = self.mask = self.pos = self.tok = self.lengths = self.ending = self.stopped = None
        self.tokens, self.feats, self.teacher = {}, {}, {}

    def run(self, batch_size: int, prefill_tokens: int | None = None):
        """Yield (prompt index, Captured) as sequences end."""
        refill_at = max(1, batch_size // 8)  # free rows worth a prefill
        while self.waiting or self.rows:
            free = batch_size - len(self.rows)
            if self.waiting and (free >= refill_at or not self.rows):
                joining = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
                for group in token_batches([len(self.prompts[i]) for i in joining], prefill_tokens):
                    self._admit([joining[g] for g in group])
            yield from self._step()

    def _forward(self, **kwargs):
        """One target forward; returns its output and the chosen layers' features on the CPU."""
        with LayerTap(self.model, self.layer_ids) as tap:
            out = self.model(**kwargs, **self.step_kwargs)
            return out, tap.features().cpu()

    def _admit(self, joining: list[int]) -> None:
        """Prefill the joining prompts together and merge them into the batch."""
        ids, new_mask, new_pos = left_pad([self.prompts[i] for i in joining], self.pad_id, self.device)
        new_cache = _new_cache(self.model)
        out, prompt_feats = self._forward(input_ids=ids, attention_mask=new_mask, position_ids=new_pos, cache=new_cache)
        for r, i in enumerate(joining):
            self.feats[i], self.tokens[i] = [prompt_feats[r, ids.shape[1] - len(self.prompts[i]) :]], []
        if self.teacher_topk:
            self._start_teacher(joining, out.logits[:, -1])
        new_tok = pick_tokens(out.logits[:, -1], self.sampling, self.generator)
        new_stop = torch.isin(new_tok, self.stops)
        new_limit = torch.as_tensor([self.limits[i] for i in joining], device=self.device)
        new_len = torch.ones_like(new_tok)
        if self.rows:
            self.cache, self.mask = _merge_caches(self.cache, self.mask, new_cache, new_mask)
            self.pos, self.tok = torch.cat([self.pos, new_pos[:, -1] + 1]), torch.cat([self.tok, new_tok])
            self.lengths, self.stopped = torch.cat([self.lengths, new_len]), torch.cat([self.stopped, new_stop])
            self.ending = torch.cat([self.ending, new_stop | (new_len >= new_limit)])
        else:
            self.cache, self.mask, self.pos, self.tok = new_cache, new_mask, new_pos[:, -1] + 1, new_tok
            self.lengths, self.stopped = new_len, new_stop
            self.ending = new_stop | (new_len >= new_limit)
        self.rows += joining

    def _start_teacher(self, joining: list[int], last_logits: torch.Tensor) -> None:
        """Nothing before the last prompt token; the last one's top-k predicts the first response token."""
        k = self.teacher_topk
        top_ids, top_logp = next_token_topk(last_logits, k)
        for r, i in enumerate(joining):
            n = len(self.prompts[i]) - 1
            not_captured = (torch.zeros(n, k, dtype=torch.long), torch.full((n, k), -math.inf))
            self.teacher[i] = [not_captured, (top_ids[r : r + 1], top_logp[r : r + 1])]

    def _step(self) -> list[tuple[int, Captured]]:
        """Feed each row's newest token: its state is that token's feature, its logits give the next token. Rows
        that end with it leave the batch; returns their sequences."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out, step_feats = self._forward(
            input_ids=self.tok[:, None], attention_mask=self.mask, position_ids=self.pos[:, None], cache=self.cache
        )
        self._record(out, step_feats[:, 0])
        done = []
        for r in self.ending.nonzero()[:, 0].tolist():
            i = self.rows[r]
            teacher = self.teacher.pop(i, None)
            finished = bool(self.stopped[r])
            feats = self.feats.pop(i)
            done.append((i, _captured(self.prompts[i], self.tokens.pop(i), feats, finished, f"prompt {i}", teacher)))
        row_limits = torch.as_tensor([self.limits[i] for i in self.rows], device=self.device)
        self.tok = pick_tokens(out.logits[:, -1], self.sampling, self.generator)
        self.lengths = self.lengths + 1
        self.stopped, at_limit = torch.isin(self.tok, self.stops), self.lengths >= row_limits
        self.pos = self.pos + 1
        keep = (~self.ending).nonzero()[:, 0]
        self.ending = self.stopped | at_limit
        if len(keep) < len(self.rows):
            self._keep_rows(keep)
        return done

    def _record(self, out, step_feats: torch.Tensor) -> None:
        """Append each row's consumed token with its feature [rows, n*H] (and teacher row)."""
        if self.teacher_topk:
            top_ids, top_logp = next_token_topk(out.logits[:, -1], self.teacher_topk)
        for r, (i, t) in enumerate(zip(self.rows, self.tok.tolist())):
            self.tokens[i].append(t)
            self.feats[i].append(step_feats[r : r + 1])
            if self.teacher_topk:
                self.teacher[i].append((top_ids[r : r + 1], top_logp[r : r + 1]))

    def _keep_rows(self, keep: torch.Tensor) -> None:
        self.rows = [self.rows[r] for r in keep.tolist()]
        if not self.rows:
            return
        self.cache.batch_select_indices(keep)
        kept = (x[keep] for x in (self.mask, self.pos, self.tok, self.lengths, self.stopped, self.ending))
        self.mask, self.pos, self.tok, self.lengths, self.stopped, self.ending = kept
        self.cache, self.mask = _trim_padding(self.cache, self.mask)


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into spare capacity instead of re-concatenating the whole cache each step
    (those copies are a large share of a batched CPU decode step). `keys`/`values` stay views of the valid
    columns; when something outside replaces them (row selection, trimming), the next append reallocates."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        n, k = self.keys.shape[2], key_states.shape[2]
        buf = getattr(self, "_buf", None)
        if (
            buf is None
            or buf[0].shape[:2] != self.keys.shape[:2]
            or self.keys.data_ptr() != buf[0].data_ptr()
            or n + k > buf[0].shape[2]
        ):
            capacity = max(64, n + k + int((n + k) * CACHE_HEADROOM))  # bounded, so a batch sized by memory fits
            buf = tuple(x.new_empty(*x.shape[:2], capacity, x.shape[3]) for x in (key_states, value_states))
            buf[0][:, :, :n], buf[1][:, :, :n] = self.keys, self.values
            self._buf = buf
        buf[0][:, :, n : n + k], buf[1][:, :, n : n + k] = key_states, value_states
        self.keys, self.values = buf[0][:, :, : n + k], buf[1][:, :, : n + k]
        return self.keys, self.values


def _new_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    cache.layers = [_GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _captured(
    prompt: list[int], response: list[int], feats: list[torch.Tensor], finished: bool, what: str, teacher: list | None
) -> Captured:
    features = torch.cat(feats)
    _check_finite(features, what)
    tokens = torch.as_tensor(list(prompt) + response, dtype=torch.long)
    top = (torch.cat([t[0] for t in teacher]), torch.cat([t[1] for t in teacher])) if teacher else None
    return Captured(tokens, torch.arange(len(tokens)) >= len(prompt), features, finished, top)


def _left_pad_columns(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _merge_caches(cache: DynamicCache, mask: torch.Tensor, new: DynamicCache, new_mask: torch.Tensor):
    """The rows of `new` appended to `cache`, both left-padded (masked) to the wider of the two."""
    width = max(mask.shape[1], new_mask.shape[1])
    for layer, add in zip(cache.layers, new.layers):
        layer.keys = torch.cat([_left_pad_columns(layer.keys, width, 2), _left_pad_columns(add.keys, width, 2)])
        layer.values = torch.cat([_left_pad_columns(layer.values, width, 2), _left_pad_columns(add.values, width, 2)])
    return cache, torch.cat([_left_pad_columns(mask, width, 1), _left_pad_columns(new_mask, width, 1)])


def _trim_padding(cache: DynamicCache, mask: torch.Tensor):
    """Drop the leading columns that no remaining row attends to (left by rows that left the batch)."""
    lead = int((mask.sum(0) == 0).int().cumprod(0).sum())
    if lead:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        mask = mask[:, lead:]
    return cache, mask


@torch.no_grad()
def capture(
    model, sequences: list[list[int]], loss_masks: list, layer_ids: list[int], *, pad_id: int, teacher_topk: int = 0
) -> list[Captured]:
    """Capture-only: one left-padded prefill over complete sequences (prompt + existing response)."""
    device = next(model.parameters()).device
    ids, mask, pos = left_pad(sequences, pad_id, device)
    with LayerTap(model, layer_ids, final=bool(teacher_topk)) as tap:
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
        feats, final = tap.features().cpu(), tap.final
    width = feats.shape[1]
    head = model.get_output_embeddings()
    results = []
    for r, (s, m) in enumerate(zip(sequences, loss_masks)):
        f = feats[r, width - len(s) :]
        _check_finite(f, f"sequence {r} of the batch")
        # `final` is the final-normed state the head reads; one row at a time keeps [S, V] logits small
        top = next_token_topk(head(final[r, width - len(s) :]), teacher_topk) if teacher_topk else None
        results.append(
            Captured(torch.as_tensor(s, dtype=torch.long), torch.as_tensor(m, dtype=torch.bool), f, True, top)
        )
    return results
