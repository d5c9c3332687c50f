"""Sampling: the filtered distribution matches transformers' warpers, and speculative rejection
sampling reproduces the target's distribution exactly (chi-square against enumeration), while a
deliberately wrong acceptance rule is caught by the same test."""

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import harness.acceptance as acceptance
from flashdraft.model import DFlashDrafter
from flashdraft.sampling import sample, sampling_probs
from flashdraft.spec import DraftSpec
from flashdraft.target import frozen_head_from_model
from harness.acceptance import Sampling, greedy_accept, rejection_sample
from harness.drafter import DrafterProposer
from harness.policies import ChainPolicy
from harness.speculative import speculative_generate
from tests.test_speculative import one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)

V = 8  # vocabulary of the distribution tests: 8^3 outcomes for three tokens


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 5), (1.3, 0.8, 0), (0.5, 0.9, 12)])
def test_sampling_probs_match_transformers_warpers(temperature, top_p, top_k):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)
    probs = sampling_probs(logits, temperature, top_p, top_k)
    torch.testing.assert_close(probs, expected)
    if top_k:
        assert ((probs > 0).sum(-1) <= top_k).all()


def test_greedy_accept():
    logits = torch.full((5, 10), -1.0)
    logits[torch.arange(5), torch.tensor([3, 4, 5, 6, 7])] = 1.0  # target argmax after each position
    assert greedy_accept(torch.tensor([3, 4, 5, 6]), logits) == (4, 7)  # all accepted, bonus from the last row
    accepted, token = greedy_accept(torch.tensor([3, 9, 5, 6]), logits)
    assert (accepted, int(token)) == (1, 4)  # the correction replaces the first wrong draft
    assert greedy_accept(torch.tensor([], dtype=torch.long), logits[:1])[0] == 0


def test_rejection_sample_one_position_keeps_p():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0, 0.0])
    q = torch.tensor([0.05, 0.05, 0.3, 0.3, 0.3, 0.0])  # q puts mass where p has none
    target = torch.stack([p, torch.full((6,), 1 / 6)])
    counts = np.zeros(6)
    for _ in range(6000):
        draft = sample(q, g).view(1)
        accepted, token = rejection_sample(draft, target, q[None], g)
        counts[int(draft) if accepted else int(token)] += 1
    assert counts[4:].sum() == 0
    assert stats.chisquare(counts[:4], p[:4].double().numpy() * 6000).pvalue > 1e-3


# --- end to end: the first three generated tokens follow the target exactly -------------------

PROMPT = torch.tensor([[1, 2, 3, 4, 5]])


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama", vocab=V, layers=2, hidden=32, seed=0)
    with torch.no_grad():  # a peaked target, so the drafter's q differs clearly from p
        target.lm_head.weight.mul_(10.0)
    torch.manual_seed(1)
    config = DraftSpec([0, 1], V - 1, block_size=4, num_draft_layers=1).draft_config(target.config)
    drafter = DFlashDrafter(config).eval()
    return target, DrafterProposer(drafter, frozen_head_from_model(target))


@torch.no_grad()
def exact_joint(target, temperature, top_p, top_k) -> np.ndarray:
    """P(t1, t2, t3) under plain sampling from the target, by enumerating all V^2 prefixes."""
    n = PROMPT.shape[1]
    ids = torch.tensor([PROMPT[0].tolist() + [a, b] for a in range(V) for b in range(V)])
    logits = target(ids).logits.double()
    p1 = sampling_probs(logits[0, n - 1], temperature, top_p, top_k)
    p2 = sampling_probs(logits[::V, n], temperature, top_p, top_k)  # row a: prefix + [a]
    p3 = sampling_probs(logits[:, n + 1], temperature, top_p, top_k).view(V, V, V)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).numpy().astype(np.float64)
    return joint / joint.sum()


def empirical_joint(target, proposer, draws, temperature, top_p, top_k, draft_cutoff=0.0) -> np.ndarray:
    """Block 4 with max_new_tokens 3: one round verifies [t1, d2, d3]; a rejection needs a second round."""
    g = torch.Generator().manual_seed(1234)
    counts = np.zeros((V, V, V))
    for _ in range(draws):
        out = speculative_generate(
            target,
            PROMPT,
            ChainPolicy(proposer, cutoff=draft_cutoff),
            max_new_tokens=3,
            sampling=Sampling(temperature, top_p, top_k, g),
        )
        counts[tuple(out.tokens)] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test; cells expected below 5 are pooled. An impossible outcome gives 0."""
    counts, expected = counts.ravel(), probs.ravel() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if expected[small].sum() > 0:
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
    return float(stats.chisquare(obs, exp).pvalue)


SETTINGS = [(1.0, 1.0, 0), (0.7, 0.8, 5)]


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_speculative_sampling_keeps_the_target_distribution(models, temperature, top_p, top_k):
    target, proposer = models
    counts = empirical_joint(target, proposer, 2000, temperature, top_p, top_k)
    assert chi_square_pvalue(counts, exact_joint(target, temperature, top_p, top_k)) > 1e-3


def test_sampling_with_a_draft_cutoff_keeps_the_target_distribution(models):
    """Verifying only a confident draft prefix (sometimes none) still samples the target."""
    target, proposer = models
    counts = empirical_joint(target, proposer, 2000, 1.0, 1.0, 0, draft_cutoff=0.2)
    assert chi_square_pvalue(counts, exact_joint(target, 1.0, 1.0, 0)) > 1e-3


def _accept_every_draft(draft_tokens, target_probs, draft_probs, generator=None):
    k = draft_tokens.shape[0]
    return k, sample(target_probs[k], generator)


def _resample_from_p(draft_tokens, target_probs, draft_probs, generator=None):
    """The right acceptance test, but the rejected position resampled from p instead of norm(max(0, p - q))."""
    accepted, _ = rejection_sample(draft_tokens, target_probs, draft_probs, generator)
    return accepted, sample(target_probs[accepted], generator)


@pytest.mark.parametrize("wrong_rule,draws", [(_accept_every_draft, 600), (_resample_from_p, 1000)])
def test_wrong_acceptance_rule_is_rejected(models, monkeypatch, wrong_rule, draws):
    """Negative control: the chi-square test has the power to see a broken rejection sampler."""
    target, proposer = models
    monkeypatch.setattr(acceptance, "rejection_sample", wrong_rule)
    temperature, top_p, top_k = SETTINGS[0]
    counts = empirical_joint(target, proposer, draws, temperature, top_p, top_k)
    assert chi_square_pvalue(counts, exact_joint(target, temperature, top_p, top_k)) < 1e-6


def test_sampling_with_a_draft_vocabulary_keeps_the_target_distribution(models):
    """Drafts restricted to half the words (the other words' logits -inf) still sample the target."""
    target, proposer = models
    restricted = DrafterProposer(proposer.drafter, proposer.head, draft_vocab=[0, 2, 4, 6])
    counts = empirical_joint(target, restricted, 2000, 1.0, 1.0, 0)
    assert chi_square_pvalue(counts, exact_joint(target, 1.0, 1.0, 0)) > 1e-3


def test_sampling_settings_are_checked_and_choose_as_the_distribution_says():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    assert torch.equal(Sampling().choose(logits), logits.argmax(dim=-1)) and Sampling().greedy
    chosen = Sampling(0.7, 0.9, 5, torch.Generator().manual_seed(3)).choose(logits)
    assert torch.equal(chosen, sample(sampling_probs(logits, 0.7, 0.9, 5), torch.Generator().manual_seed(3)))
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling(**bad)
