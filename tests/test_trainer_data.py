"""Training data: anchor counts from the store, skips decided before sharding, rank plans, loader."""

import numpy as np
import pytest
import torch

from flashdraft.store import StoreReader, write_store
from trainer.anchors import count_valid_anchors
from trainer.data import Prefetcher, TrainingData, valid_anchor_counts, valid_anchor_counts_from_masks

H = 8


def make_store(path, n=40, seed=0, teacher_topk=0):
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        s = int(rng.integers(6, 40))
        mask = np.zeros(s, bool)
        mask[int(rng.integers(1, s)) :] = True  # some responses are too short to hold a block of 8
        seqs.append(
            {
                "seq_id": f"q{i}",
                "input_ids": rng.integers(0, 50, s),
                "loss_mask": mask,
                "features": torch.randn(s, 2 * H),
            }
        )
        if teacher_topk:
            logp = torch.log_softmax(torch.randn(s, 50), -1).topk(teacher_topk, -1)
            seqs[-1]["teacher"] = (logp.indices, logp.values)
    return write_store(
        path,
        seqs,
        layer_ids=[2, 5],
        hidden_size=H,
        dtype="float32",
        shard_tokens=256,
        chunk_tokens=32,
        teacher_topk=teacher_topk,
    )


def data(store, **kw):
    args = dict(
        layer_ids=[5], block_size=8, num_anchors=4, max_length=30, mask_token_id=49, gamma=4.0, heldout_fraction=0.2
    )
    args.update(kw)
    return TrainingData([store.path], **args)


def test_valid_anchor_counts_match_per_sequence_reads(tmp_path):
    store = make_store(tmp_path / "s")
    counts = valid_anchor_counts(store, 8, 30)
    expected = [count_valid_anchors(store.read(i).loss_mask[:30], 8) for i in range(len(store))]
    np.testing.assert_array_equal(counts, expected)
    assert (counts == 0).any() and (counts > 0).any()


def test_anchor_counts_from_the_span_index_equal_the_loss_masks_for_multi_turn_masks(tmp_path):
    rng, seqs = np.random.default_rng(3), []
    for i in range(60):  # masks of 0-3 runs, at the start, middle and end, some shorter than a block
        s = int(rng.integers(3, 50))
        mask = np.zeros(s, bool)
        for _ in range(int(rng.integers(0, 4))):
            a = int(rng.integers(0, s))
            mask[a : a + int(rng.integers(1, 12))] = True
        seqs.append({"seq_id": f"m{i}", "input_ids": rng.integers(0, 50, s), "loss_mask": mask})
        seqs[-1]["features"] = torch.zeros(s, H)
    write_store(tmp_path / "s", seqs, layer_ids=[1], hidden_size=H, dtype="bfloat16", shard_tokens=256, chunk_tokens=32)
    reader = StoreReader(tmp_path / "s")
    assert reader.response_spans is not None and len(reader.response_spans[0]) > len(reader)
    for block, max_length in ((8, 30), (4, 50), (16, 20), (2, 3)):
        from_index = valid_anchor_counts(reader, block, max_length)
        np.testing.assert_array_equal(from_index, valid_anchor_counts_from_masks(reader, block, max_length))
        expected = [count_valid_anchors(s["loss_mask"][:max_length], block) for s in seqs]
        np.testing.assert_array_equal(from_index, expected)


def test_plans_skip_no_anchor_sequences_on_every_rank_and_shard_evenly(tmp_path):
    d = data(make_store(tmp_path / "s"))
    plans = [d.plan(1, token_budget=120, world_size=3, rank=r, grad_accum=2) for r in range(3)]
    assert len({len(p.steps) for p in plans}) == 1  # same number of steps on every rank
    assert len({p.skipped for p in plans}) == 1 and plans[0].skipped > 0
    seen = [i for p in plans for s in p.steps for mb in s for i in mb]
    usable = set(np.flatnonzero((d.valid_anchors > 0) & ~d.heldout).tolist())
    assert set(seen) == usable  # every usable sequence, nothing else (the wrap-around only repeats)
    assert not set(np.flatnonzero(d.heldout)) & set(seen)
    for p in plans:
        for s in p.steps:
            for mb in s:  # token budget respected unless a single sequence exceeds it
                cost = len(mb) * (d.lengths[mb].max() + np.minimum(d.valid_anchors[mb], 4).max() * 8)
                assert cost <= 120 or len(mb) == 1
    # one rank accumulating 2 sees exactly what 2 ranks see in one step each
    one = d.plan(1, token_budget=120, world_size=1, rank=0, grad_accum=2)
    two = [d.plan(1, token_budget=120, world_size=2, rank=r, grad_accum=1) for r in range(2)]
    assert [s for s in one.steps] == [[a[0], b[0]] for a, b in zip(*[p.steps for p in two])]
    # deterministic per epoch, reshuffled across epochs
    assert d.plan(1, token_budget=120).steps == d.plan(1, token_budget=120).steps
    assert d.plan(1, token_budget=120).steps != d.plan(2, token_budget=120).steps
    held = d.plan(0, split="heldout", token_budget=120)
    assert {i for s in held.steps for mb in s for i in mb} <= set(np.flatnonzero(d.heldout))


def test_batches_hold_the_right_blocks_and_loader_keeps_order(tmp_path):
    store = make_store(tmp_path / "s")
    d = data(store)
    mbs = [mb for s in d.plan(0, token_budget=120).steps for mb in s]
    loader = Prefetcher(d, mbs, 0, workers=2, depth=3)
    batches = list(loader)
    assert [b.seq_ids for b in batches] == [[store.seq_ids[i] for i in mb] for mb in mbs]
    b = batches[0]
    seq = store.read(mbs[0][0], layers=[5])
    s = min(len(seq.input_ids), 30)
    torch.testing.assert_close(b.context[0, :s], seq.features[:s])
    assert (b.context[0, s:] == 0).all()
    a = b.anchors[0][b.weights[0].view(-1, 8).sum(-1) > 0]
    assert len(a) == min(4, d.valid_anchors[mbs[0][0]])
    assert (b.block_ids[0].view(-1, 8)[: len(a), 0] == torch.as_tensor(seq.input_ids[a.numpy()])).all()
    assert (b.block_ids[0].view(-1, 8)[:, 1:] == 49).all()
    np.testing.assert_array_equal(
        b.position_ids[0, b.context_len : b.context_len + 8].numpy(), int(a[0]) + np.arange(8)
    )


def test_soft_label_rows_are_the_targets_topk_after_the_previous_token(tmp_path):
    store = make_store(tmp_path / "s", teacher_topk=3)
    d = data(store, teacher=True)
    mb = [mb for s in d.plan(0, token_budget=120).steps for mb in s][0]
    b = d.batch(mb, 0)
    assert b.teacher_ids.shape == b.teacher_probs.shape == (*b.labels.shape, 3)
    for r, i in enumerate(mb):
        seq = store.read(i, teacher=True)
        for j, a in enumerate(b.anchors[r].tolist()):
            for k in range(1, 8):
                if b.weights[r, j * 8 + k] > 0:  # label a + k: the target's top-3 after token a + k - 1
                    assert b.teacher_ids[r, j * 8 + k].tolist() == seq.teacher_ids[a + k - 1].tolist()
                    p = np.exp(seq.teacher_logp[a + k - 1])
                    np.testing.assert_allclose(b.teacher_probs[r, j * 8 + k].numpy(), p / p.sum(), rtol=1e-5)
    assert data(store).batch(mb, 0).teacher_ids is None  # hard labels: not read
    plain = make_store(tmp_path / "plain")
    with pytest.raises(ValueError, match="hold none"):  # a store without the target's top-k is refused for soft labels
        data(plain, teacher=True)


def test_frequent_tokens_count_the_response_tokens_of_the_training_split(tmp_path):
    store = make_store(tmp_path / "s")
    d = data(store)
    counts = np.zeros(50, np.int64)
    for i in range(len(store)):
        if not d.heldout[i]:
            seq = store.read(i)
            np.add.at(counts, seq.input_ids[:30][seq.loss_mask[:30]], 1)
    words = d.frequent_tokens(10, 50)
    assert len(words) == 10 and (np.diff(words) > 0).all()
    assert counts[words].min() >= np.delete(counts, words).max()  # no word left out is more frequent
    assert set(d.frequent_tokens(50, 50).tolist()) == set(range(50))
