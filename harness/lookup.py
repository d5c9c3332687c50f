"""Lookup drafts: the tokens that followed an earlier occurrence of the newest n-gram, in the prompt or in the
output so far. No model runs; code and chat answers copy identifiers, signatures and phrases verbatim.

`dflash_lookup` rounds use it before the drafter: where the newest `ngram` tokens occurred before, the target
verifies what followed them and the drafter is not run; elsewhere the DFlash tree drafts. Combining a model
drafter with a suffix match this way is what Arctic Inference's Suffix Decoding does with its speculators
(arXiv 2411.04975); the transformers prompt lookup baseline (`harness/prompt_lookup.py`) always verifies a match
of 2 tokens or else 1, and a plain step where none is found.
"""

from __future__ import annotations

import torch


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


def draft_without_drafter(ids: torch.Tensor, num_tokens: int, *, lookup_ngram: int = 0, datastore=None) -> tuple[torch.Tensor | None, bool]:
    """The draft of a round that skips the drafter, and whether the datastore gave it: the lookup draft of the
    newest `lookup_ngram` tokens (0: none), else the continuation `datastore` (a `harness.datastore.Datastore`)
    has for them; (None, False) when neither has one. Served rounds and their replay both choose here."""
    found = lookup_draft(ids, lookup_ngram, num_tokens) if lookup_ngram else None
    if found is None and datastore is not None:
        found = datastore.draft(ids, num_tokens)
        return found, found is not None
    return found, False
