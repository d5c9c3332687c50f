"""Loss weights, the chunked cross entropy (value and gradient) and the acceptance metric."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.loss import block_labels, block_loss, default_gamma, loss_rows, loss_words, position_weights, summarize


def test_default_gamma_is_the_papers_for_its_block_sizes():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(13) == pytest.approx(6.0) and default_gamma(4) == 2.0 and default_gamma(2) == 1.0


def test_position_weights_follow_the_paper():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1.0
    np.testing.assert_allclose(w[1:], np.exp(-np.arange(15) / 7.0), rtol=1e-6)


def test_labels_zero_weight_past_end_and_outside_response():
    ids = np.arange(100, 120)
    mask = np.ones(20, bool)
    mask[:5] = False
    mask[12] = False
    labels, w = block_labels(ids, mask, np.array([3, 9, 16]), 4, 2.0)
    assert labels.shape == (3, 4)
    np.testing.assert_array_equal(labels[0], [0, 0, 105, 106])  # 103, 104 are prompt
    assert w[0, 0] == 0 and w[0, 1] == 0 and w[0, 2] == np.float32(math.exp(-0.5))
    np.testing.assert_array_equal(labels[1], [109, 110, 111, 0])  # 112 is not a response token
    assert w[1, 0] == 0 and w[1, 3] == 0 and w[1, 1] == 1.0
    np.testing.assert_array_equal(w[2] > 0, [False, True, True, True])  # 16..19 inside


def test_chunked_loss_equals_plain_weighted_cross_entropy():
    torch.manual_seed(0)
    b, n, bs, h, v = 2, 3, 4, 8, 50
    hidden = torch.randn(b, n * bs, h, requires_grad=True)
    head = torch.randn(v, h)
    labels = torch.randint(0, v, (b, n * bs))
    weights = torch.rand(b, n * bs) * (torch.rand(b, n * bs) > 0.3)
    loss, stats = block_loss(hidden, head, labels, weights, bs, chunk=5)
    loss.backward()
    ref_h = hidden.detach().clone().requires_grad_(True)
    ce = F.cross_entropy((ref_h @ head.T).view(-1, v), labels.view(-1), reduction="none")
    ref = (ce * weights.view(-1)).sum() / weights.sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, ref_h.grad)
    assert stats["weight"] == weights.sum()


def test_acceptance_counts_leading_correct_positions():
    # vocabulary of 4, head = identity: the prediction is argmax of the hidden state itself
    bs = 4
    head = torch.eye(4)
    labels = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 0, 0]])
    weights = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float)  # block 2 is padding
    preds = torch.tensor([[0, 1, 2, 0, 0, 1, 0, 3, 0, 0, 0, 0]])  # block 0: 2 right then wrong; block 1: 1 right
    hidden = F.one_hot(preds, 4).float() * 5
    _, stats = block_loss(hidden, head, labels, weights, bs)
    assert stats["blocks"] == 2
    assert stats["accept"] == (1 + 2) + (1 + 1)
    m = summarize(stats, 1.0, 1)
    assert m["tau"] == 2.5
    assert m["acc_1"] == 1.0 and m["acc_2"] == 0.5 and m["acc_3"] == 0.5
    assert m["acc"] == 4 / 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predictions_are_the_first_argmax_on_ties(dtype):
    # head = identity over a vocabulary of 6 and hidden states from {0, 1, 2}: most rows hold tied maxima
    torch.manual_seed(0)
    bs = 4
    hidden = torch.randint(0, 3, (1, 40 * bs, 6)).to(dtype)
    labels = hidden[0].float().argmax(dim=-1)[None]  # torch's argmax: the first maximal index
    weights = torch.ones(1, 40 * bs)
    _, stats = block_loss(hidden, torch.eye(6, dtype=dtype), labels, weights, bs, chunk=7)
    assert stats["pos_correct"].tolist() == stats["pos_total"].tolist()
    assert (hidden[0].max(dim=-1).values[:, None] == hidden[0]).sum(-1).gt(1).float().mean() > 0.3


@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_soft_labels_are_cross_entropy_against_the_mixed_target_distribution(alpha):
    torch.manual_seed(1)
    b, n, bs, h, v, k = 2, 3, 4, 8, 50, 5
    hidden = torch.randn(b, n * bs, h, requires_grad=True)
    head = torch.randn(v, h)
    weights = torch.rand(b, n * bs) * (torch.rand(b, n * bs) > 0.3)
    t_ids = torch.stack([torch.randperm(v)[:k] for _ in range(b * n * bs)]).view(b, n * bs, k)
    t_probs = torch.softmax(torch.randn(b, n * bs, k), -1)
    labels = t_ids[..., 0]
    loss, _ = block_loss(hidden, head, labels, weights, bs, chunk=5, soft=(t_ids, t_probs, alpha))
    loss.backward()
    target = (1 - alpha) * F.one_hot(labels, v).float()
    target = target.scatter_add(-1, t_ids, alpha * t_probs)
    ref_h = hidden.detach().clone().requires_grad_(True)
    ce = -(torch.log_softmax(ref_h @ head.T, -1) * target).sum(-1)
    ref = (ce * weights).sum() / weights.sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, ref_h.grad)
    hard, _ = block_loss(hidden.detach(), head, labels, weights, bs, chunk=5)
    assert not torch.allclose(loss.detach(), hard)  # the soft labels really change the objective


@pytest.mark.parametrize("alpha", [None, 0.5])
def test_a_loss_vocabulary_is_the_softmax_over_its_words_and_the_batch_labels(alpha):
    torch.manual_seed(2)
    b, n, bs, h, v, k = 2, 3, 4, 8, 60, 3
    hidden = torch.randn(b, n * bs, h, requires_grad=True)
    head = torch.randn(v, h)
    labels = torch.randint(0, v, (b, n * bs))
    weights = torch.rand(b, n * bs) * (torch.rand(b, n * bs) > 0.3)
    t_ids, t_probs = torch.randint(0, v, (b, n * bs, k)), torch.softmax(torch.randn(b, n * bs, k), -1)
    soft = (t_ids, t_probs, alpha) if alpha else None
    vocab = torch.tensor([1, 4, 7, 9, 20])
    loss, stats = block_loss(hidden, head, labels, weights, bs, chunk=5, soft=soft, vocab=vocab)
    loss.backward()
    rows = weights.view(-1) > 0
    words = set(vocab.tolist()) | set(labels.view(-1)[rows].tolist())
    if alpha:
        words |= set(t_ids.view(-1, k)[rows].view(-1).tolist())
    assert len(words) < v  # the softmax really leaves words out
    keep = torch.tensor(sorted(words))
    ref_h = hidden.detach().clone().requires_grad_(True)
    logits = torch.full((b, n * bs, v), float("-inf"))
    logits[..., keep] = (ref_h @ head.T)[..., keep]
    target = F.one_hot(labels, v).float() * (1 - (alpha or 0.0))
    if alpha:
        target = target.scatter_add(-1, t_ids, alpha * t_probs)
    ce = -(torch.log_softmax(logits, -1).clamp_min(-1e30) * target).sum(-1)
    ref = (ce * weights).sum() / weights.sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, ref_h.grad)
    full, _ = block_loss(hidden.detach(), head, labels, weights, bs, chunk=5, soft=soft)
    assert loss.detach() < full  # the words left out no longer share the probability mass
    preds = logits.argmax(-1).view(-1)[rows]
    assert stats["pos_correct"].sum() == (preds == labels.view(-1)[rows]).sum()
    # hidden states that point at their labels: every prediction is right, in the target's word ids
    _, stats = block_loss(F.one_hot(labels, v).float() * 5, torch.eye(v), labels, weights, bs, soft=soft, vocab=vocab)
    assert stats["pos_correct"].tolist() == stats["pos_total"].tolist() and stats["pos_total"].sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha, vocab", [(None, None), (0.5, None), (None, [1, 4, 7, 9, 20]), (0.5, [3, 5, 30])])
def test_rows_and_words_counted_on_the_host_give_the_same_loss_bit_for_bit(dtype, alpha, vocab):
    """The trainer hands block_loss the rows with a loss weight and the loss vocabulary's words of the batch as the
    loader counted them on the host (`loss_rows`, `loss_words`), so that on a GPU nothing waits for the device to
    count them: loss, gradient and stats are those of counting them on the device, bit for bit."""
    torch.manual_seed(3)
    b, n, bs, h, v, k = 3, 5, 4, 16, 60, 3
    hidden = torch.randn(b, n * bs, h, dtype=dtype, requires_grad=True)
    head = torch.randn(v, h, dtype=dtype)
    labels = torch.randint(0, v, (b, n * bs))
    weights = torch.rand(b, n * bs) * (torch.rand(b, n * bs) > 0.3)
    t_ids, t_probs = torch.randint(0, v, (b, n * bs, k)), torch.softmax(torch.randn(b, n * bs, k), -1)
    soft = (t_ids, t_probs, alpha) if alpha else None
    vocab = torch.tensor(vocab) if vocab else None
    rows = torch.from_numpy(loss_rows(weights.numpy()))
    words = None
    if vocab is not None:
        words = torch.from_numpy(
            loss_words(vocab.numpy(), labels.numpy(), weights.numpy(), t_ids.numpy() if soft else None)
        )
    runs = []
    for host in (None, dict(rows=rows, words=words)):
        loss, stats = block_loss(hidden, head, labels, weights, bs, chunk=7, soft=soft, vocab=vocab, **(host or {}))
        (grad,) = torch.autograd.grad(loss, hidden)
        runs.append((loss, grad, stats))
    (loss, grad, stats), (host_loss, host_grad, host_stats) = runs
    assert torch.equal(host_loss, loss) and torch.equal(host_grad, grad)
    assert all(torch.equal(host_stats[key], stats[key]) for key in stats)
