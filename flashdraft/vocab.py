"""Draft vocabularies: the words a drafter's softmax is restricted to.

A target's responses use few of its words, while the output head scores all of them: on a CPU the head is a large
share of a draft.
EAGLE-3 trains its drafter over a frequency-ranked subset and FR-Spec drafts over one at serve time; the
target still verifies over every word, so the output stays exact and only drafts of a rare word are lost.
"""

from __future__ import annotations

import numpy as np


def frequent_tokens(sequences, k: int, vocab_size: int, max_length: int | None = None) -> np.ndarray:
    """The k most frequent response tokens (ties to the lower id), sorted by id. `sequences`: (input_ids,
    loss_mask) pairs, as `StoreReader.token_sequences` yields them; the tokens whose mask is set are counted,
    in the first `max_length` positions of each sequence where given."""
    if not 0 < k <= vocab_size:
        raise ValueError(f"a draft vocabulary needs 0 < k <= the vocabulary size {vocab_size}, got k = {k}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in sequences:
        ids, mask = np.asarray(ids)[:max_length], np.asarray(mask, dtype=bool)[:max_length]
        counts += np.bincount(ids[mask], minlength=vocab_size)
    return np.sort(np.argsort(-counts, kind="stable")[:k])
