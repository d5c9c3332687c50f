"""The llama.cpp benchmark's parsing and parity arithmetic (the benchmark itself builds llama.cpp: not run here)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_llamacpp as bench  # noqa: E402

LOG = """
accepted 3/7 draft tokens, the last target token is: (42)
clear kv cache from any extra tokens, n_past = 57
accepted 0/7 draft tokens, the last target token is: (7)
accepted 7/7 draft tokens, the last target token is: (9)
decoded   13 tokens in    0.500 seconds, speed:   26.000 t/s
n_draft   = 7
n_predict = 13
n_drafted = 21
n_accept  = 10
"""


def test_rounds_read_from_the_debug_log():
    assert [int(a) + 1 for a, _ in bench.SPEC_ROUND.findall(LOG)] == [4, 1, 8]
    counts = {k: int(v) for k, v in bench.SPEC_COUNT.findall(LOG)}
    assert counts == {"n_predict": 13, "n_drafted": 21, "n_accept": 10}
    assert counts["n_predict"] - counts["n_accept"] == 3  # rounds: each commits its accepted drafts + 1


def test_common_prefix_counts_to_the_first_difference():
    assert bench.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert bench.common_prefix([1, 2], [1, 2, 3]) == 2
    assert bench.common_prefix("abc", "abd") == 2


def test_round_parity_compares_rounds_that_start_together():
    # harness: prefill gives token 0, rounds start at 1: [1..3], [4], [5..8]; llama.cpp from 0: [0..3], [4], [5..7]
    harness, llama = [3, 1, 4], [4, 1, 3]
    assert bench.round_starts(harness, 1) == {1: 3, 4: 1, 5: 4}
    assert bench.round_starts(llama, 0) == {0: 4, 4: 1, 5: 3}
    # rounds at 4 and 5 start together; at 5 they commit 4 vs 3 tokens
    assert bench.round_parity(harness, llama, agree=9) == (2, 1)
    # a round that reaches past the agreeing stretch is not compared
    assert bench.round_parity(harness, llama, agree=7) == (1, 1)
