"""Speculative decoding, batch size 1, KV caches on both models: one verify-and-accept loop, any draft policy.

The loop mirrors the reference `dflash.model.dflash_generate`: the target prefills the prompt and emits the first
token; each round a policy (`harness.policies`) drafts the tokens to verify after the newest committed token, the
target verifies them in one forward pass, the accepted drafts plus one target token are committed
(`harness.acceptance`), and the target cache keeps the committed tokens whose K/V it has computed (the newest
token's K/V come with the next round). Greedy acceptance keeps the plain greedy output token for token; sampling
uses speculative rejection sampling, which keeps the target's distribution. The target features of every committed
token are kept for the drafter until its next call. Without a policy this is plain decoding: one token a forward.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from flashdraft.model import extract_context_feature
from harness.acceptance import GREEDY, Sampling, accept
from harness.policies import PLAIN


@dataclass
class Generation:
    tokens: list[int]  # generated tokens, prompt excluded, EOS included when it stopped generation
    num_prompt_tokens: int
    acceptance_lengths: list[int] = field(default_factory=list)  # committed tokens per round
    verified_drafts: list[int] = field(default_factory=list)  # drafts the target checked per round
    sources: list[str] = field(default_factory=list)  # the policy that drafted each round (harness.policies.Draft)
    prefill_s: float = 0.0  # the prompt forward that emits the first token
    decode_s: float = 0.0  # everything after the prefill
    draft_s: list[float] = field(default_factory=list)  # per round
    verify_s: list[float] = field(default_factory=list)
    bookkeeping_s: list[float] = field(default_factory=list)
    stopped: bool = False  # ended on a stop token

    @property
    def decode_tokens(self) -> int:
        """Tokens emitted after the prefill."""
        return sum(self.acceptance_lengths)

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per target forward after the prefill."""
        return self.decode_tokens / len(self.acceptance_lengths) if self.acceptance_lengths else None

    @property
    def lookup_rounds(self) -> int:
        """Rounds that verified a draft found without a model (lookup and datastore rounds)."""
        return sum(source in ("lookup", "datastore") for source in self.sources)

    @property
    def datastore_rounds(self) -> int:
        return self.sources.count("datastore")


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def cache_kwarg(model) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _crop(cache: DynamicCache, length: int) -> None:
    cache.crop(length - cache.get_seq_length())  # transformers 5.x: crop takes minus the count to drop


def _keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Keep the cached K/V of positions [0, start) and of the verify block's `rows` (in that order), drop
    the other rows of the block: after a tree verify, the accepted path becomes the cache's tail."""
    if rows == list(range(len(rows))):
        return _crop(cache, start + len(rows))
    keep = torch.cat([torch.arange(start), start + torch.tensor(rows)]).to(cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(-2, keep), layer.values.index_select(-2, keep)


def _check(policy, sampling: Sampling, max_new_tokens: int, prompt_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_tokens == 0:
        raise ValueError("empty prompt")
    if policy.greedy_only and not sampling.greedy:
        raise ValueError(
            f"{type(policy).__name__} is greedy only (temperature 0), got temperature {sampling.temperature}"
        )


@torch.inference_mode()
def speculative_generate(
    target, input_ids, policy=PLAIN, *, max_new_tokens: int, stop_token_ids=(), sampling: Sampling = GREEDY
) -> Generation:
    """Generate up to `max_new_tokens` after `input_ids` (list or [1, n] tensor), each round drafted by `policy`
    (`harness.policies`; PLAIN: plain decoding with a KV cache). Returns a Generation with the tokens, per-round
    acceptance lengths and per-round draft / verify / bookkeeping wall time."""
    device = target.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).view(1, -1)
    n = ids.shape[1]
    _check(policy, sampling, max_new_tokens, n)
    max_length = n + max_new_tokens
    layer_ids = policy.layer_ids
    stop = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=device)
    output = torch.zeros((1, max_length + 1), dtype=torch.long, device=device)
    output[:, :n] = ids
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()
    kv = {cache_kwarg(target): cache, "use_cache": True, "output_hidden_states": layer_ids is not None}
    result = Generation([], n)

    t0 = clock(device)
    out = target(ids, position_ids=torch.arange(n, device=device)[None], **kv, logits_to_keep=1)
    output[0, n] = sampling.choose(out.logits[0, -1])
    context = extract_context_feature(out.hidden_states, layer_ids) if layer_ids is not None else None
    result.prefill_s = clock(device) - t0

    policy.start()
    start = n  # position of the newest committed token, whose K/V the target has not computed yet
    stopped = bool(torch.isin(output[0, n], stop))
    decode_start = clock(device)
    while start + 1 < max_length and not stopped:
        t0 = clock(device)
        draft = policy.draft(output[0], start, max_length - start, context, sampling)
        t1 = clock(device)
        out = target(draft.tokens, position_ids=draft.positions, attention_mask=draft.mask, **kv)
        t2 = clock(device)
        path, token = accept(draft, out.logits[0], sampling)
        output[0, start + 1 : start + len(path) + 1] = draft.tokens[0, path]
        output[0, start + len(path) + 1] = token
        produced = min(len(path) + 1, max_length - start - 1)
        hits = torch.isin(output[0, start + 1 : start + produced + 1], stop).nonzero()
        if hits.numel():
            produced, stopped = int(hits[0, 0]) + 1, True
        rows = [0, *path][:produced]  # block rows now committed with their K/V: the newest token + accepted drafts
        if layer_ids is not None:  # the drafter gets the features of every committed token at its next call
            new = extract_context_feature(out.hidden_states, layer_ids)[:, rows]
            context = new if draft.took_context else torch.cat([context, new], dim=1)
        _keep_rows(cache, start, rows)
        start += produced
        result.acceptance_lengths.append(produced)
        result.verified_drafts.append(draft.tokens.shape[1] - 1)
        result.sources.append(draft.source)
        result.draft_s.append(t1 - t0)
        result.verify_s.append(t2 - t1)
        result.bookkeeping_s.append(clock(device) - t2)

    result.tokens = output[0, n : min(start + 1, max_length)].tolist()
    result.stopped = stopped
    result.decode_s = clock(device) - decode_start
    return result
