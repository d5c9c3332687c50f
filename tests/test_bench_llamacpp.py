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
    # one that ends exactly where the outputs stop agreeing is: (position, harness round, llama.cpp round)
    assert bench.aligned_rounds(harness, llama, agree=8) == [(4, 1, 1), (5, 2, 2)]


# a draft-dflash debug log as llama.cpp writes it (-v): each drafted position's top candidates, then the round's
# verification; a piece may itself be a newline
DRAFT_LOG = """
 - seq_id 0, draft candidate   0, pos   0:     11 (   0.990) 'a'
 - seq_id 0, draft candidate   1, pos   0:     12 (   0.010) 'b'
 - seq_id 0, draft candidate   0, pos   1:    198 (   0.970) '
'
 - seq_id 0, draft candidate   1, pos   1:     13 (   0.020) 'c'
 - seq_id 0, draft candidate   0, pos   2:     14 (   0.900) 'd'
accepted 2/3 draft tokens, the last target token is: (15)
clear kv cache from any extra tokens, n_past = 57
 - seq_id 0, draft candidate   0, pos   0:     16 (   0.990) 'e'
 - seq_id 0, draft candidate   0, pos   1:      2 (   0.990) '<|im_end|>'
 - seq_id 0, draft candidate   0, pos   2:     17 (   0.990) 'f'
accepted 3/3 draft tokens, the last target token is: (18)
"""


def test_round_log_gives_each_rounds_drafts_and_committed_tokens():
    import llamacpp

    rounds = llamacpp.spec_rounds(DRAFT_LOG)
    assert rounds == [
        {"drafts": [11, 198, 14], "committed": [11, 198, 15]},
        {"drafts": [16, 2, 17], "committed": [16, 2, 17, 18]},
    ]
    assert [len(r["committed"]) for r in rounds] == [int(a) + 1 for a, _ in bench.SPEC_ROUND.findall(DRAFT_LOG)]
    # the loop stops at an end-of-generation token: what it emitted of that round ends there
    assert llamacpp.cut_at_stop(rounds, [2])[1]["committed"] == [16, 2]
    assert llamacpp.cut_at_stop(rounds, [11]) == [{"drafts": [11, 198, 14], "committed": [11]}]
    assert llamacpp.cut_at_stop(rounds, []) == rounds
