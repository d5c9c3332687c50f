"""Draft vocabularies: the k most frequent response tokens, prompts not counted, ties to the lower id."""

import numpy as np
import pytest

from flashdraft.vocab import frequent_tokens


def test_frequent_tokens_counts_response_tokens_only():
    sequences = [
        (np.array([9, 9, 9, 9, 5, 5, 7]), np.array([0, 0, 0, 0, 1, 1, 1], dtype=bool)),  # 9 is prompt only
        (np.array([9, 7, 3, 3, 5]), np.array([0, 1, 1, 1, 1], dtype=bool)),
    ]
    assert frequent_tokens(sequences, 3, 10).tolist() == [3, 5, 7]  # 5 x3, 7 x2, 3 x2; sorted by id
    assert frequent_tokens(sequences, 2, 10).tolist() == [3, 5]  # the tie 3 / 7 goes to the lower id
    assert frequent_tokens(sequences, 1, 10, max_length=5).tolist() == [3]  # in the first 5 positions: 3 x2, 5 x2, 7 x1
    assert frequent_tokens(sequences, 5, 10).tolist() == [0, 1, 3, 5, 7]  # then unseen words, lowest ids first
    with pytest.raises(ValueError, match="0 < k"):
        frequent_tokens(sequences, 0, 10)
