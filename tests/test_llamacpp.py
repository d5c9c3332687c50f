"""llama.cpp serving's parsing and parity arithmetic (harness/llamacpp.py), which the llama.cpp benchmark
(benchmarks/bench_llamacpp.py) and the gate's llama.cpp leg read; both build or need a llama.cpp: not run here."""

import sys

import pytest

from harness import llamacpp

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
    assert [int(a) + 1 for a, _ in llamacpp.SPEC_ROUND.findall(LOG)] == [4, 1, 8]
    counts = {k: int(v) for k, v in llamacpp.SPEC_COUNT.findall(LOG)}
    assert counts == {"n_predict": 13, "n_drafted": 21, "n_accept": 10}
    assert counts["n_predict"] - counts["n_accept"] == 3  # rounds: each commits its accepted drafts + 1


def test_common_prefix_counts_to_the_first_difference():
    assert llamacpp.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert llamacpp.common_prefix([1, 2], [1, 2, 3]) == 2
    assert llamacpp.common_prefix("abc", "abd") == 2


def test_round_parity_compares_rounds_that_start_together():
    # harness: prefill gives token 0, rounds start at 1: [1..3], [4], [5..8]; llama.cpp from 0: [0..3], [4], [5..7]
    harness, llama = [3, 1, 4], [4, 1, 3]
    assert llamacpp.round_starts(harness, 1) == {1: 3, 4: 1, 5: 4}
    assert llamacpp.round_starts(llama, 0) == {0: 4, 4: 1, 5: 3}
    # rounds at 4 and 5 start together; at 5 they commit 4 vs 3 tokens
    assert llamacpp.round_parity(harness, llama, agree=9) == (2, 1)
    # a round that reaches past the agreeing stretch is not compared
    assert llamacpp.round_parity(harness, llama, agree=7) == (1, 1)
    # one that ends exactly where the outputs stop agreeing is: (position, harness round, llama.cpp round)
    assert llamacpp.aligned_rounds(harness, llama, agree=8) == [(4, 1, 1), (5, 2, 2)]


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
    rounds = llamacpp.spec_rounds(DRAFT_LOG)
    assert rounds == [
        {"drafts": [11, 198, 14], "committed": [11, 198, 15]},
        {"drafts": [16, 2, 17], "committed": [16, 2, 17, 18]},
    ]
    assert [len(r["committed"]) for r in rounds] == [int(a) + 1 for a, _ in llamacpp.SPEC_ROUND.findall(DRAFT_LOG)]
    # the loop stops at an end-of-generation token: what it emitted of that round ends there
    assert llamacpp.cut_at_stop(rounds, [2])[1]["committed"] == [16, 2]
    assert llamacpp.cut_at_stop(rounds, [11]) == [{"drafts": [11, 198, 14], "committed": [11]}]
    assert llamacpp.cut_at_stop(rounds, []) == rounds


def test_export_gguf_of_a_missing_drafter_is_one_line_naming_it(monkeypatch, tmp_path):
    missing = tmp_path / "no-drafter"
    monkeypatch.setattr(sys, "argv", ["llamacpp", "export-gguf", str(missing)])
    with pytest.raises(SystemExit) as stop:
        llamacpp.main()
    assert str(missing) in str(stop.value.code) and "no config.json" in str(stop.value.code)
