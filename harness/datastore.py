"""Datastore drafts: what the target wrote after the same n-gram in its own earlier responses.

The feature store of the training prompts already holds the target's responses to thousands of prompts;
a small target repeats its phrasing across them ("Here is a", "def __init__(self", "I hope this helps").
`Datastore` keeps, for every `ngram` tokens seen before a response token, the token that followed them
most often, where it did so at least `min_count` times and in at least `min_share` of the cases; a draft
follows that table greedily from the newest `ngram` tokens of the context. With `min_ngram` < `ngram` it keeps
such a table for each shorter n-gram too, and each step of a draft takes the longest n-gram that has one (an
n-gram language model's backoff). Retrieval drafting from a
corpus is REST's (He et al., arXiv 2311.08252); Suffix Decoding keeps such a tree over earlier outputs
next to the one over the request (arXiv 2411.04975). No model runs; a draft costs dictionary lookups.

The datastore is built from the *training* store only, with the eval prompts' sequences left out (see
`harness/__main__.py`), so held-out prompts are never looked up in their own responses.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch


class Datastore:
    def __init__(
        self, sequences, *, ngram: int = 4, min_count: int = 2, min_share: float = 0.5, min_ngram: int | None = None
    ):
        """`sequences`: (input_ids, loss_mask) pairs; the tokens whose mask is set (the responses) are the ones
        the table predicts, from the `ngram` (down to `min_ngram`) tokens before each (which may reach into the
        prompt)."""
        min_ngram = ngram if min_ngram is None else min_ngram
        if not 1 <= min_ngram <= ngram or min_count < 1 or not 0.0 <= min_share <= 1.0:
            raise ValueError(
                f"datastore needs 1 <= min_ngram <= ngram, min_count >= 1 and min_share in [0, 1]; "
                f"got ngram {ngram}, min_ngram {min_ngram}, min_count {min_count}, min_share {min_share}"
            )
        self.ngram, self.min_ngram, self.min_count, self.min_share = ngram, min_ngram, min_count, min_share
        pairs: Counter = Counter()
        self.sequences = self.tokens = 0
        for input_ids, loss_mask in sequences:
            ids = np.asarray(input_ids, dtype=np.int64).tolist()
            predicted = np.flatnonzero(np.asarray(loss_mask, dtype=bool))
            predicted = predicted[predicted >= ngram].tolist()
            if not predicted:
                continue
            self.sequences += 1
            self.tokens += len(predicted)
            for n in range(min_ngram, ngram + 1):
                pairs.update((tuple(ids[i - n : i]), ids[i]) for i in predicted)
        totals: Counter = Counter()
        best: dict[tuple, tuple[int, int]] = {}
        for (key, token), count in pairs.items():
            totals[key] += count
            if count > best.get(key, (-1, 0))[1]:
                best[key] = (token, count)
        self.next_token = {
            key: token
            for key, (token, count) in best.items()
            if count >= min_count and count >= min_share * totals[key]
        }

    @classmethod
    def from_store(cls, path, *, exclude=(), **kwargs) -> Datastore:
        """The responses of the feature store at `path`, minus the sequences whose ids are in `exclude`."""
        from flashdraft.store import StoreReader, is_store

        if not path or not is_store(path):
            raise FileNotFoundError(
                f"no feature store at {str(path)!r} to build the datastore from (eval.datastore): "
                "run make features first, or drop dflash_datastore from eval.methods"
            )
        store, exclude = StoreReader(path), set(exclude)
        store_ids = set(store.seq_ids)
        datastore = cls(store.token_sequences(skip=exclude), **kwargs)
        datastore.excluded = len(exclude & store_ids)
        return datastore

    def __len__(self) -> int:
        return len(self.next_token)

    def draft(self, ids: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
        """At most `num_tokens` tokens continuing `ids` (1-D) through the table; None when none of its newest
        `ngram` .. `min_ngram` tokens have a confident continuation."""
        if ids.numel() < self.ngram or num_tokens < 1:
            return None
        window = ids[-self.ngram :].tolist()
        drafted = []
        while len(drafted) < num_tokens:
            token = None
            for n in range(self.ngram, self.min_ngram - 1, -1):
                token = self.next_token.get(tuple(window[-n:]))
                if token is not None:
                    break
            if token is None:
                break
            drafted.append(token)
            window.append(token)
        return torch.tensor(drafted, dtype=ids.dtype, device=ids.device) if drafted else None
