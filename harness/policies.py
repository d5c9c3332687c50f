"""Draft policies: what the target verifies in a round of the speculative loop (`harness.speculative`).

A policy's `draft(ids, start, room, context, sampling)` returns a `Draft`: the newest committed token
`ids[start]` followed by the tokens to verify, their positions (and, for a tree, its attention mask). `room` is
how many positions are left before max_new_tokens (the newest token's included), `context` the target features
of the tokens verified since the drafter last ran (None when the policy reads none).

  PlainPolicy      no drafts: one target forward a token (plain decoding)
  ChainPolicy      the drafter's block, its top (or sampled) token a position; with a `cutoff`, only the prefix
                   whose cumulative draft confidence reaches it
  TreePolicy       a tree of the draft's most probable candidates (`harness.tree`; greedy only)
  LookupPolicy     what followed an earlier occurrence of the newest n-gram in the prompt or output, else the
                   fallback policy's draft (greedy only)
  DatastorePolicy  the training responses' continuation of the newest n-gram (`harness.datastore`), else the
                   fallback policy's draft (greedy only)

A lookup or datastore round runs no model: the drafter's context stays pending until its next call. Combining
a model drafter with a suffix match this way is what Arctic Inference's Suffix Decoding does with its
speculators (arXiv 2411.04975).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.sampling import sample
from harness.tree import DraftTree, build_tree, tree_mask


@dataclass
class Draft:
    tokens: torch.Tensor  # [1, 1 + k]: the newest committed token, then the k tokens to verify
    positions: torch.Tensor  # [1, 1 + k]
    source: str  # the policy that drafted it: plain, chain, tree, lookup or datastore
    took_context: bool = False  # the drafter ran: the features pending before this round are in its cache
    tree: DraftTree | None = None  # a tree draft: tokens[0, 1:] are its nodes
    mask: torch.Tensor | None = None  # the tree's attention mask
    draft_probs: torch.Tensor | None = None  # a sampled chain: the distribution each draft was drawn from

    @classmethod
    def chain(cls, ids: torch.Tensor, start: int, drafts: torch.Tensor, source: str, **kw) -> Draft:
        tokens = torch.cat([ids[start : start + 1], drafts])[None]
        return cls(tokens, torch.arange(start, start + tokens.shape[1], device=ids.device)[None], source, **kw)


class PlainPolicy:
    """No drafts: the round verifies the newest token alone."""

    layer_ids = None
    greedy_only = False

    def start(self) -> None:
        pass

    def draft(self, ids, start, room, context, sampling) -> Draft:
        return Draft.chain(ids, start, ids[:0], "plain")


PLAIN = PlainPolicy()


def verified_prefix(draft_logits: torch.Tensor, cutoff: float) -> int:
    """How many leading draft positions have a cumulative confidence (top draft probability at
    temperature 1) of at least `cutoff`. The rule looks at the draft distributions only, never at the
    drawn tokens: choosing by a drawn token's own probability would bias which drafts reach the
    acceptance test and break the target distribution when sampling."""
    confidence = torch.softmax(draft_logits.float(), dim=-1).amax(dim=-1)
    return int((torch.cumprod(confidence, 0) >= cutoff).sum())


class _DrafterPolicy:
    """Runs `proposer` (a `harness.drafter.DrafterProposer` or any callable of its shape) on the block
    [newest token, MASK x (size - 1)], size = min(block_size, room); a block of 1 is a plain step."""

    greedy_only = False

    def __init__(self, proposer, block_size: int | None = None):
        self.proposer = proposer
        self.block_size = block_size or proposer.block_size
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def layer_ids(self):
        """The target layers whose features the drafter reads (None: none, or no drafter call at block size 1)."""
        return getattr(self.proposer, "layer_ids", None) if self.block_size > 1 else None

    def start(self) -> None:
        if self.block_size > 1:
            self.proposer.start()

    def draft_logits(self, ids, start, room, context) -> torch.Tensor | None:
        size = min(self.block_size, room)
        if size == 1:
            return None
        block = torch.full((1, size), self.proposer.mask_token_id, dtype=torch.long, device=ids.device)
        block[0, 0] = ids[start]
        return self.proposer(block, context, start)


class ChainPolicy(_DrafterPolicy):
    """The drafter's block verified as one chain; `cutoff` > 0 verifies only its confident prefix
    (`verified_prefix`), which keeps the output exact and shortens the verify forward."""

    def __init__(self, proposer, block_size: int | None = None, cutoff: float = 0.0):
        super().__init__(proposer, block_size)
        if not 0.0 <= cutoff <= 1.0:
            raise ValueError(f"draft_cutoff must be in [0, 1], got {cutoff}")
        self.cutoff = cutoff

    def draft(self, ids, start, room, context, sampling) -> Draft:
        logits = self.draft_logits(ids, start, room, context)
        if logits is None:
            return PLAIN.draft(ids, start, room, context, sampling)
        probs = None
        if sampling.greedy:
            drafts = logits.argmax(dim=-1)
        else:
            probs = sampling.probs(logits)
            drafts = sample(probs, sampling.generator)
        if self.cutoff > 0:  # every draft is drawn first, so the random draws do not depend on the cutoff
            k = verified_prefix(logits, self.cutoff)
            drafts, probs = drafts[:k], None if probs is None else probs[:k]
        return Draft.chain(ids, start, drafts, "chain", took_context=True, draft_probs=probs)


class TreePolicy(_DrafterPolicy):
    """A tree of the `size` most probable candidate paths, `branching` tokens a block position (greedy only)."""

    greedy_only = True

    def __init__(self, proposer, size: int = 7, branching: int = 4, block_size: int | None = None):
        super().__init__(proposer, block_size)
        if size < 1 or branching < 1:
            raise ValueError(f"tree_size and tree_branching must be >= 1, got {size} and {branching}")
        self.size, self.branching = size, branching

    def draft(self, ids, start, room, context, sampling) -> Draft:
        logits = self.draft_logits(ids, start, room, context)
        if logits is None:
            return PLAIN.draft(ids, start, room, context, sampling)
        tree = build_tree(logits, self.size, self.branching)
        tokens = torch.cat([ids[start : start + 1], tree.tokens])[None]
        positions = start + torch.tensor([0, *tree.depths], device=ids.device)[None]
        return Draft(tokens, positions, "tree", took_context=True, tree=tree, mask=tree_mask(tree, start, ids.device))


def lookup_draft(ids: torch.Tensor, ngram: int, num_tokens: int) -> torch.Tensor | None:
    """At most `num_tokens` tokens that followed the earliest earlier occurrence of the last `ngram` tokens of
    `ids` (1-D: prompt and output so far); None when those `ngram` tokens did not occur before. The earliest
    match with a continuation, as transformers' prompt lookup takes it, for one n-gram size."""
    n = ids.numel()
    if ngram < 1 or num_tokens < 1 or n <= ngram:
        return None
    windows = ids[: n - 1].unfold(0, ngram, 1)  # windows that end before the last token have a continuation
    hits = (windows == ids[n - ngram :]).all(dim=1).nonzero()
    if not len(hits):
        return None
    first = int(hits[0, 0]) + ngram
    return ids[first : first + num_tokens]


class _FallbackPolicy:
    """Drafts without a model where it finds a continuation (`found`), else asks `fallback`."""

    greedy_only = True
    source = ""

    def __init__(self, num_tokens: int, fallback=PLAIN):
        if num_tokens < 1:
            raise ValueError(
                f"{self.source} rounds verify at least 1 token (prompt_lookup_num_tokens), got {num_tokens}"
            )
        self.num_tokens, self.fallback = num_tokens, fallback

    @property
    def layer_ids(self):
        return self.fallback.layer_ids

    @property
    def proposer(self):
        """The fallback's drafter (None: it runs none)."""
        return getattr(self.fallback, "proposer", None)

    def start(self) -> None:
        self.fallback.start()

    def found(self, ids: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
        raise NotImplementedError

    def draft(self, ids, start, room, context, sampling) -> Draft:
        found = self.found(ids[: start + 1], min(self.num_tokens, room - 1))
        if found is None:
            return self.fallback.draft(ids, start, room, context, sampling)
        return Draft.chain(ids, start, found, self.source)


class LookupPolicy(_FallbackPolicy):
    """Where the newest `ngram` tokens occurred before in the prompt or output, up to `num_tokens` of what
    followed them (`lookup_draft`); without a drafter fallback this is prompt lookup decoding in our loop."""

    source = "lookup"

    def __init__(self, ngram: int, num_tokens: int = 10, fallback=PLAIN):
        if ngram < 1:
            raise ValueError(f"lookup_ngram must be >= 1, got {ngram}")
        super().__init__(num_tokens, fallback)
        self.ngram = ngram

    def found(self, ids, num_tokens):
        return lookup_draft(ids, self.ngram, num_tokens)


class DatastorePolicy(_FallbackPolicy):
    """Up to `num_tokens` of the continuation `datastore` (a `harness.datastore.Datastore`) has for the newest
    tokens."""

    source = "datastore"

    def __init__(self, datastore, num_tokens: int = 10, fallback=PLAIN):
        super().__init__(num_tokens, fallback)
        self.datastore = datastore

    def found(self, ids, num_tokens):
        return self.datastore.draft(ids, num_tokens)
