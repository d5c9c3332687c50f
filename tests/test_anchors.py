"""Anchor draws: bounds, response-only, determinism, redraw per epoch."""

import numpy as np
import pytest

from trainer.anchors import count_valid_anchors, draw_anchors, follow_anchors, hard_start_weights, valid_anchor_positions


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


def test_hard_start_weights_follow_the_targets_uncertainty():
    top1 = np.array([0.9, 0.5, 0.99, 0.2, 0.9])  # P(top token) after tokens 0..4
    logp = np.log(np.stack([top1, np.full(5, 0.01)], axis=1))
    hard = np.array([1.0, 0.1, 0.5, 0.01, 0.8])  # position 0 has no producer: as hard as it gets
    np.testing.assert_allclose(hard_start_weights(logp, 0.0), hard / hard.mean())
    np.testing.assert_allclose(hard_start_weights(logp, 1.0), np.ones(5))
    np.testing.assert_allclose(hard_start_weights(logp, 0.5), 0.5 + 0.5 * hard / hard.mean())
    with pytest.raises(ValueError, match="uniform_share"):
        hard_start_weights(logp, 1.5)


def test_weighted_draws_follow_the_weights_and_stay_deterministic():
    mask = response_mask(200, 20)
    weights = np.where(np.arange(200) % 4 == 0, 3.0, 1.0)  # every fourth position three times as likely
    hits = np.zeros(200)
    for epoch in range(400):
        a = draw_anchors(mask, 16, 20, seed=0, epoch=epoch, seq_id="w", weights=weights)
        np.testing.assert_array_equal(a, draw_anchors(mask, 16, 20, seed=0, epoch=epoch, seq_id="w", weights=weights))
        assert len(set(a.tolist())) == 20 and ((a <= 200 - 16) & mask[a + 1]).all()
        hits[a] += 1
    valid = valid_anchor_positions(mask, 16)
    heavy, light = valid[valid % 4 == 0], valid[valid % 4 != 0]
    assert 2.0 < hits[heavy].mean() / hits[light].mean() < 3.5  # below 3: drawn without replacement
    zero = np.where(np.arange(200) % 2 == 0, 1.0, 0.0)  # enough even positions for every draw: odd ones never
    assert (draw_anchors(mask, 16, 20, seed=1, epoch=0, seq_id="z", weights=zero) % 2 == 0).all()


def test_follow_anchors_start_where_the_next_served_round_would():
    mask = response_mask(60, 10)  # block 8: valid anchors 9..52
    kw = dict(seed=0, epoch=0, seq_id="f")
    # a round at a that matched L drafts starts the next at a + L + 1; 50 + 2 + 1 = 53 is no valid anchor: 50 stays
    np.testing.assert_array_equal(follow_anchors(mask, 8, np.array([10, 20, 30, 50]), np.array([3, 7, 0, 2]), 1.0, **kw),
                                  [14, 28, 31, 50])
    # two follow-ons on one position: the second anchor stays where it was
    np.testing.assert_array_equal(follow_anchors(mask, 8, np.array([10, 11]), np.array([1, 0]), 1.0, **kw), [11, 12])
    np.testing.assert_array_equal(follow_anchors(mask, 8, np.array([10, 20]), np.array([3, 3]), 0.0, **kw), [10, 20])
    with pytest.raises(ValueError, match="follow share"):
        follow_anchors(mask, 8, np.array([10]), np.array([0]), 1.5, **kw)


def test_a_share_of_the_anchors_follows_and_the_pick_is_seeded():
    mask = response_mask(600, 50)
    anchors = draw_anchors(mask, 8, 20, seed=0, epoch=0, seq_id="s")
    accepted = np.arange(20) % 3
    picks = []
    for seq_id in ("s", "t"):
        out = follow_anchors(mask, 8, anchors, accepted, 0.5, seed=0, epoch=0, seq_id=seq_id)
        np.testing.assert_array_equal(out, follow_anchors(mask, 8, anchors, accepted, 0.5, seed=0, epoch=0, seq_id=seq_id))
        assert (np.diff(out) > 0).all() and len(out) <= 20 and ((out <= 600 - 8) & mask[out + 1]).all()
        moved = set(out.tolist()) - set(anchors.tolist())
        assert moved <= set((anchors + accepted + 1).tolist())
        kept = set(out.tolist()) & set(anchors.tolist())
        assert len(kept) >= 10 and len(moved) <= 10  # half of them move (a follow-on can land on another anchor)
        picks.append(moved)
    assert picks[0] != picks[1]
