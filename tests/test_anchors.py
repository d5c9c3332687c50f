"""Anchor draws: bounds, response-only, determinism, redraw per epoch."""

import numpy as np
import pytest

from trainer.anchors import count_valid_anchors, draw_anchors, valid_anchor_positions


def response_mask(s, prompt_len):
    m = np.zeros(s, bool)
    m[prompt_len:] = True
    return m


def test_valid_positions_bounds_and_response_only():
    mask = response_mask(40, 10)
    mask[20] = False  # a non-response hole inside the response
    p = valid_anchor_positions(mask, 16)
    assert p.min() == 9 and p.max() == 40 - 16
    assert 19 not in p and mask[p + 1].all()
    assert count_valid_anchors(response_mask(16, 1), 16) == 1  # p = 0 is the only fit
    assert count_valid_anchors(response_mask(15, 1), 16) == 0  # too short for one block
    assert count_valid_anchors(response_mask(60, 46), 16) == 0  # response only in the last B-1 tokens
    with pytest.raises(ValueError, match="block_size"):
        valid_anchor_positions(mask, 1)


def test_draw_is_deterministic_without_replacement_and_redrawn_per_epoch():
    mask = response_mask(600, 50)
    a = draw_anchors(mask, 16, 64, seed=3, epoch=0, seq_id="x")
    assert len(a) == 64 and len(set(a.tolist())) == 64 and (np.diff(a) > 0).all()
    assert ((a <= 600 - 16) & mask[a + 1]).all()
    np.testing.assert_array_equal(a, draw_anchors(mask, 16, 64, seed=3, epoch=0, seq_id="x"))
    assert not np.array_equal(a, draw_anchors(mask, 16, 64, seed=3, epoch=1, seq_id="x"))
    assert not np.array_equal(a, draw_anchors(mask, 16, 64, seed=4, epoch=0, seq_id="x"))
    assert not np.array_equal(a, draw_anchors(mask, 16, 64, seed=3, epoch=0, seq_id="y"))
    # fewer valid positions than asked for: all of them
    small = draw_anchors(response_mask(30, 10), 16, 512, seed=0, epoch=0, seq_id="x")
    np.testing.assert_array_equal(small, np.arange(9, 15))


def test_draws_cover_the_valid_positions_uniformly():
    mask = response_mask(200, 20)
    hits = np.zeros(200)
    for epoch in range(400):
        hits[draw_anchors(mask, 16, 20, seed=0, epoch=epoch, seq_id="u")] += 1
    valid = valid_anchor_positions(mask, 16)
    assert hits.sum() == hits[valid].sum()
    expected = 400 * 20 / len(valid)
    assert np.abs(hits[valid] - expected).max() < 0.5 * expected
