"""Speculative decoding with a DFlash drafter, batch size 1, KV caches on both models.

The loop mirrors the reference `dflash.model.dflash_generate`: the target prefills the prompt and
emits the first token; each round the drafter proposes the block [last token, MASK x (B-1)]
conditioned on the target features of every verified token (its cache holds the context K/V,
block K/V are dropped); the target verifies the block in one forward pass; the accepted drafts
plus one target token are committed and the target cache is cropped to the committed tokens whose
K/V it has computed (the newest token's K/V come with the next block). Greedy acceptance keeps the
plain greedy output token for token; sampling uses speculative rejection sampling, which keeps the
target's distribution. Block size 1 is plain decoding: no drafter call, one token per forward.
With `tree_size`, the target verifies a tree of the draft's most probable candidates instead of one
chain (`harness/tree.py`) and the cache keeps the accepted path (greedy only). With `lookup_ngram`, a round
whose newest n-gram occurred before verifies what followed it instead of running the drafter
(`harness/lookup.py`; greedy only); the drafter's next call then gets the features of every token since.
With a `datastore`, a round without such a match verifies the datastore's continuation the same way.
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from flashdraft.model import extract_context_feature
from flashdraft.sampling import check_sampling, sample, sampling_probs
from harness.lookup import draft_without_drafter
from harness.sampling import greedy_accept, rejection_sample
from harness.tree import build_tree, first_nodes, greedy_path, tree_mask


class DrafterProposer:
    """Drafts a block with a DFlashDrafter and the target's frozen embedding and output head.

    Proposers are called as `proposer(block [1, B], context [1, c, n*H] | None, start) -> draft
    logits [B-1, V]`, where `context` holds the target features of the tokens verified since the
    last call and `start` is the absolute position of block[0]. `start()` resets per-sequence state.

    `draft_vocab` (token ids, `flashdraft.vocab.frequent_tokens`): the draft is scored over those words only,
    by a copy of their rows of the head, and every other word gets logit -inf (FR-Spec). The target still
    verifies over all words, so the output is unchanged; drafts of the words left out are lost.
    """

    def __init__(self, drafter, head, draft_vocab=None):
        self.drafter, self.head = drafter, head
        self.block_size = drafter.block_size
        self.mask_token_id = drafter.mask_token_id
        self.layer_ids = drafter.target_layer_ids  # features the loop must capture (None: none)
        self.cache = None
        self.vocab = self.vocab_weight = None
        if draft_vocab is not None:
            weight = head.lm_head.weight
            self.vocab = torch.as_tensor(draft_vocab, dtype=torch.long, device=weight.device)
            words = weight.shape[0]
            if self.vocab.ndim != 1 or self.vocab.numel() == 0 or int(self.vocab.min()) < 0 or int(self.vocab.max()) >= words:
                raise ValueError(f"draft_vocab must be a non-empty 1-D list of token ids below the target's {words} words, "
                                 f"got shape {tuple(self.vocab.shape)}")
            self.vocab_weight = weight.detach().index_select(0, self.vocab).contiguous()

    def start(self) -> None:
        self.cache = self.drafter.new_cache()

    def __call__(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        c = context.shape[1]
        if self.cache.length + c != start:
            raise RuntimeError(f"drafter cache holds {self.cache.length} + {c} new context tokens, block starts at {start}")
        positions = torch.arange(start - c, start + block.shape[1], device=block.device)[None]
        hidden = self.drafter(self.head.embed_tokens(block), context, positions, cache=self.cache)[0, 1:]
        if self.vocab is None:
            return self.head.lm_head(hidden)
        logits = hidden.new_full((hidden.shape[0], self.head.lm_head.weight.shape[0]), float("-inf"))
        return logits.index_copy_(1, self.vocab, F.linear(hidden, self.vocab_weight))


@dataclass
class Generation:
    tokens: list[int]  # generated tokens, prompt excluded, EOS included when it stopped generation
    num_prompt_tokens: int
    block_size: int
    acceptance_lengths: list[int] = field(default_factory=list)  # committed tokens per round (max B)
    verified_drafts: list[int] = field(default_factory=list)  # drafts the target checked per round
    prefill_s: float = 0.0  # the prompt forward that emits the first token
    decode_s: float = 0.0  # everything after the prefill
    draft_s: list[float] = field(default_factory=list)  # per round
    verify_s: list[float] = field(default_factory=list)
    bookkeeping_s: list[float] = field(default_factory=list)
    lookup_rounds: int = 0  # rounds that verified a lookup draft instead of the drafter's (datastore rounds included)
    datastore_rounds: int = 0  # of those, rounds whose draft came from the datastore
    stopped: bool = False  # ended on a stop token

    @property
    def decode_tokens(self) -> int:
        """Tokens emitted after the prefill."""
        return sum(self.acceptance_lengths)

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per target forward after the prefill."""
        return self.decode_tokens / len(self.acceptance_lengths) if self.acceptance_lengths else None


def verified_prefix(draft_logits: torch.Tensor, cutoff: float) -> int:
    """How many leading draft positions have a cumulative confidence (top draft probability at
    temperature 1) of at least `cutoff`. The rule looks at the draft distributions only, never at the
    drawn tokens: choosing by a drawn token's own probability would bias which drafts reach the
    acceptance test and break the target distribution when sampling."""
    confidence = torch.softmax(draft_logits.float(), dim=-1).amax(dim=-1)
    return int((torch.cumprod(confidence, 0) >= cutoff).sum())


def cost_aware_count(path_probs, verify_ms, draft_ms: float = 0.0) -> int:
    """How many of the draft nodes (in an order where every node's parent comes first) to verify for the most
    committed tokens per ms: k maximizing (1 + sum_{i<=k} p_i) / (draft_ms + verify_ms[k]), p_i the draft's
    probability of node i's path (the chance it is accepted, taking the draft at its word), verify_ms[k] the
    cost of a target forward over k + 1 rows; of equal rates, the fewest rows."""
    p = torch.as_tensor(path_probs, dtype=torch.float64)
    n = min(len(p), len(verify_ms) - 1)
    expected = 1 + torch.cat([p.new_zeros(1), torch.cumsum(p[:n], 0)])
    cost = draft_ms + torch.tensor(list(verify_ms[: n + 1]), dtype=expected.dtype)
    rate = expected / cost
    return int((rate >= rate.max() * (1 - 1e-6)).nonzero()[0])  # a tie (to float noise) goes to the fewer rows


def cost_aware_prefix(draft_logits: torch.Tensor, verify_ms, draft_ms: float = 0.0) -> int:
    """How many leading drafts of a chain to verify (`cost_aware_count`): the path probability of draft i is the
    cumulative confidence (top draft probability) of the first i. Like `verified_prefix` it reads the draft
    distributions only, never the drawn tokens."""
    confidence = torch.softmax(draft_logits.float(), dim=-1).amax(dim=-1)
    return cost_aware_count(torch.cumprod(confidence, 0), verify_ms, draft_ms)


def measure_verify_ms(target, rows: int, context: int = 256, repeats: int = 5) -> list[float]:
    """The wall ms of a target forward over 1..`rows` rows after a cache of `context` tokens (random ids), the
    costs `cost_aware_count` weighs: the medians of `repeats` timings a row count, interleaved over the counts,
    fitted by a line a + b * rows (b >= 0), since a shared CPU's noise would otherwise rank the counts at random."""
    device = target.device
    ids = torch.randint(0, target.config.vocab_size, (1, context + rows), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        target(ids[:, :context], **{_cache_kwarg(target): cache}, use_cache=True, logits_to_keep=1)
        times = [[] for _ in range(rows)]
        for _ in range(repeats + 1):  # the first pass warms up
            for n in range(1, rows + 1):
                t0 = clock(device)
                target(ids[:, context : context + n], **{_cache_kwarg(target): cache}, use_cache=True)
                times[n - 1].append(clock(device) - t0)
                cache.crop(-n)
    medians = torch.tensor([1000 * statistics.median(t[1:]) for t in times], dtype=torch.float64)
    n = torch.arange(1, rows + 1, dtype=torch.float64)
    slope = max(0.0, float(((n - n.mean()) * (medians - medians.mean())).sum() / ((n - n.mean()) ** 2).sum().clamp_min(1e-12)))
    return (medians.mean() + slope * (n - n.mean())).clamp_min(1e-3).tolist()


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _cache_kwarg(model) -> str:
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


@torch.inference_mode()
def speculative_generate(
    target,
    input_ids,
    *,
    max_new_tokens: int,
    proposer=None,
    stop_token_ids=(),
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    draft_cutoff: float = 0.0,
    tree_size: int = 0,
    tree_branching: int = 4,
    lookup_ngram: int = 0,
    lookup_tokens: int = 10,
    datastore=None,
    verify_ms=None,
) -> Generation:
    """Generate up to `max_new_tokens` after `input_ids` (list or [1, n] tensor).

    `proposer` is a DrafterProposer (or any callable of the same shape); without one, or with
    block_size 1, this is plain decoding with a KV cache. Returns a Generation with the tokens,
    per-round acceptance lengths and per-round draft / verify / bookkeeping wall time.

    `draft_cutoff` > 0 verifies only the longest draft prefix whose cumulative draft confidence is
    at least `draft_cutoff` (0 verifies the whole block, as the reference does). Any prefix keeps
    the output exact; a shorter verify forward is cheaper where its cost grows with its length (CPU).

    `verify_ms` (from `measure_verify_ms`) verifies the draft prefix `cost_aware_prefix` picks instead, weighing
    the draft's confidence against what a verify of each length costs on this machine (the draft's own cost: the
    mean of this generation's drafts so far); with `tree_size`, the tree's first nodes `cost_aware_count` picks.

    `tree_size` > 0 verifies a tree of that many draft candidates instead of one chain (`harness.tree`:
    the most probable paths, `tree_branching` tokens a position); greedy only.

    `lookup_ngram` > 0: where the newest `lookup_ngram` tokens occurred earlier in the prompt or output, the
    round verifies up to `lookup_tokens` tokens that followed them (`harness.lookup.lookup_draft`) and skips
    the drafter; greedy only. Without a proposer this is prompt lookup decoding in this loop.

    `datastore` (a `harness.datastore.Datastore`): where no lookup draft was found, a round verifies the
    datastore's draft, if it has one, the same way; greedy only."""
    check_sampling(temperature, top_p, top_k)
    if not 0.0 <= draft_cutoff <= 1.0:
        raise ValueError(f"draft_cutoff must be in [0, 1], got {draft_cutoff}")
    if tree_size < 0:
        raise ValueError(f"tree_size must be >= 0 (0: verify one chain), got {tree_size}")
    if tree_size and temperature > 0:
        raise ValueError(f"tree verification is greedy only (temperature 0); got tree_size {tree_size} at temperature {temperature}")
    if lookup_ngram < 0 or lookup_tokens < 1:
        raise ValueError(f"lookup_ngram must be >= 0 (0: no lookup rounds) and lookup_tokens >= 1, got {lookup_ngram} and {lookup_tokens}")
    if lookup_ngram and temperature > 0:
        raise ValueError(f"lookup rounds are greedy only (temperature 0); got lookup_ngram {lookup_ngram} at temperature {temperature}")
    if datastore is not None and temperature > 0:
        raise ValueError(f"datastore rounds are greedy only (temperature 0); got a datastore at temperature {temperature}")
    if draft_cutoff > 0 and (tree_size or verify_ms is not None):
        raise ValueError("draft_cutoff chooses what to verify, and so do tree_size and verify_ms: set one of them "
                         "(tree_size and verify_ms combine: the tree's first nodes by cost)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    block_size = block_size or (proposer.block_size if proposer is not None else 1)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if block_size > 1 and proposer is None:
        raise ValueError(f"block_size {block_size} needs a proposer (a drafter); block_size 1 is plain decoding")
    device = target.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).view(1, -1)
    n = ids.shape[1]
    if n == 0:
        raise ValueError("empty prompt")
    max_length = n + max_new_tokens
    layer_ids = getattr(proposer, "layer_ids", None) if block_size > 1 else None
    stop = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=device)

    def choose(logits: torch.Tensor) -> torch.Tensor:
        if temperature > 0:
            return sample(sampling_probs(logits, temperature, top_p, top_k), generator)
        return logits.argmax(dim=-1)

    # The tail beyond the committed tokens stays MASK: the next block is [last token, MASK...].
    fill = proposer.mask_token_id if proposer is not None else 0
    output = torch.full((1, max_length + 1), fill, dtype=torch.long, device=device)
    output[:, :n] = ids
    positions = torch.arange(max_length + 1, device=device)[None]
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()
    kv = {_cache_kwarg(target): cache}
    result = Generation([], n, block_size)

    t0 = clock(device)
    out = target(
        ids, position_ids=positions[:, :n], **kv, use_cache=True,
        logits_to_keep=1, output_hidden_states=layer_ids is not None,
    )
    output[0, n] = choose(out.logits[0, -1])
    context = extract_context_feature(out.hidden_states, layer_ids) if layer_ids is not None else None
    result.prefill_s = clock(device) - t0

    if proposer is not None and block_size > 1:
        proposer.start()
    start = n  # position of the newest committed token, whose K/V the target has not computed yet
    stopped = bool(torch.isin(output[0, n], stop))
    drafter_s, draft_ms = [], 0.0  # the drafter's rounds (not lookup rounds) and their mean ms
    decode_start = clock(device)
    while start + 1 < max_length and not stopped:
        t0 = clock(device)
        size = min(block_size, max_length - start)  # the last block shrinks to end at max_new_tokens
        block = output[:, start : start + size].clone()
        verify_positions, verify_mask, tree, drafted = positions[:, start : start + size], None, None, False
        found, from_datastore = draft_without_drafter(
            output[0, : start + 1], min(lookup_tokens, max_length - start - 1), lookup_ngram=lookup_ngram, datastore=datastore
        )
        result.datastore_rounds += from_datastore
        if found is not None:
            block = torch.cat([block[:, :1], found[None]], dim=1)
            verify_positions = positions[:, start : start + block.shape[1]]
            result.lookup_rounds += 1
        elif size > 1:
            drafted = True
            draft_logits = proposer(block, context, start)
            if tree_size:
                tree = build_tree(draft_logits, tree_size, tree_branching)
                if verify_ms is not None:
                    tree = first_nodes(tree, cost_aware_count(tree.path_probs, verify_ms, draft_ms))
                block = torch.cat([block[:, :1], tree.tokens[None]], dim=1)
                verify_positions = start + torch.tensor([0, *tree.depths], device=device)[None]
                verify_mask = tree_mask(tree, start, device)
            elif temperature > 0:
                draft_probs = sampling_probs(draft_logits, temperature, top_p, top_k)
                block[0, 1:] = sample(draft_probs, generator)
            else:
                block[0, 1:] = draft_logits.argmax(dim=-1)
            if tree is None and (verify_ms is not None or draft_cutoff > 0):  # a chain: verify its chosen prefix
                if verify_ms is not None:
                    size = 1 + cost_aware_prefix(draft_logits, verify_ms, draft_ms)
                else:
                    size = 1 + verified_prefix(draft_logits, draft_cutoff)
                block, verify_positions = block[:, :size], verify_positions[:, :size]
                if temperature > 0:
                    draft_probs = draft_probs[: size - 1]
        result.verified_drafts.append(block.shape[1] - 1)
        t1 = clock(device)
        out = target(
            block, position_ids=verify_positions, attention_mask=verify_mask, **kv, use_cache=True,
            output_hidden_states=layer_ids is not None,
        )
        t2 = clock(device)
        logits = out.logits[0]
        if tree is not None:
            path, token = greedy_path(tree, logits)
        elif temperature > 0:
            target_probs = sampling_probs(logits, temperature, top_p, top_k)
            if size > 1:
                accepted, token = rejection_sample(block[0, 1:], target_probs, draft_probs, generator)
            else:
                accepted, token = 0, sample(target_probs[-1], generator)
            path = list(range(1, accepted + 1))
        else:
            accepted, token = greedy_accept(block[0, 1:], logits)
            path = list(range(1, accepted + 1))
        accepted = len(path)
        output[0, start + 1 : start + accepted + 1] = block[0, path]
        output[0, start + accepted + 1] = token
        produced = min(accepted + 1, max_length - start - 1)
        hits = torch.isin(output[0, start + 1 : start + produced + 1], stop).nonzero()
        if hits.numel():
            produced, stopped = int(hits[0, 0]) + 1, True
        rows = [0, *path][:produced]  # block rows now committed with their K/V: the last token + accepted drafts
        if layer_ids is not None:
            new = extract_context_feature(out.hidden_states, layer_ids)[:, rows]
            context = new if drafted else torch.cat([context, new], dim=1)  # a lookup round leaves the drafter's context pending
        _keep_rows(cache, start, rows)
        start += produced
        result.acceptance_lengths.append(produced)
        t3 = clock(device)
        result.draft_s.append(t1 - t0)
        if drafted:
            drafter_s.append(t1 - t0)
            draft_ms = 1000 * statistics.fmean(drafter_s)  # what `verify_ms` weighs a round's rows against
        result.verify_s.append(t2 - t1)
        result.bookkeeping_s.append(t3 - t2)

    result.tokens = output[0, n : min(start + 1, max_length)].tolist()
    result.stopped = stopped
    result.decode_s = clock(device) - decode_start
    return result
