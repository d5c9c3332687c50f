"""Speculative decoding: greedy output equals plain decoding token for token, the commit logic
(acceptance, EOS, max_new_tokens, shrinking last block) is exact, and the loop matches the reference
`dflash.model.dflash_generate` on the same drafter. Tiny Llama and Qwen3 targets built in code."""

import copy
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec, default_layer_ids
from flashdraft.target import (
    EXACT_ATTENTION,
    EXACT_ATTENTION_FP32,
    cpu_has_fast_bf16,
    exact_base_rows,
    frozen_head_from_model,
    make_verification_exact,
    needs_exact_verification,
)
from harness.acceptance import Sampling
from harness.baselines import prompt_lookup_generate
from harness.drafter import DrafterProposer
from harness.policies import ChainPolicy, LookupPolicy, TreePolicy, lookup_draft
from harness.speculative import speculative_generate
from harness.tree import build_tree, follow, greedy_path, tree_mask

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")  # the reference's own calls

ARCHS = ("llama", "qwen3")
VOCAB = 64
MASK = VOCAB - 1


def tiny_target(arch: str, vocab: int = VOCAB, layers: int = 6, hidden: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **kw))
    return model.eval().requires_grad_(False)


def tiny_drafter(
    target, block_size: int = 16, mask_token_id: int = MASK, layers: int = 2, seed: int = 1
) -> DFlashDrafter:
    torch.manual_seed(seed)
    layer_ids = sorted(
        set(default_layer_ids(target.config.num_hidden_layers))
    )  # a 6-layer target repeats ids: once each
    config = DraftSpec(layer_ids, mask_token_id, block_size, layers).draft_config(target.config)
    return DFlashDrafter(config).eval().requires_grad_(False)


def make_agreeing(target, drafter, favourite: int, mask_token_id: int = MASK) -> None:
    """Make an untrained drafter agree with the target sometimes: the mask token's embedding points at
    the output-head row of the token the target's greedy loops settle on, and the drafter's residual
    branches are scaled up so that the context still changes some drafts."""
    with torch.no_grad():
        target.get_input_embeddings().weight[mask_token_id] = target.lm_head.weight[favourite]
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.mul_(3.0)
            layer.mlp.down_proj.weight.mul_(3.0)


def random_prompts(count: int, seed: int = 0, vocab: int = VOCAB) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab - 2, (1, int(torch.randint(3, 20, (1,), generator=g))), generator=g)
        for _ in range(count)
    ]


def favourite_token(target, prompts, max_new_tokens: int = 32) -> int:
    tails = [t for p in prompts for t in speculative_generate(target, p, max_new_tokens=max_new_tokens).tokens[-8:]]
    return max(set(tails), key=tails.count)


class OracleProposer:
    """Proposes the plain greedy continuation, wrong exactly at the generated-token indices `wrong`."""

    layer_ids = None
    mask_token_id = MASK

    def __init__(self, plain: list[int], num_prompt_tokens: int, block_size: int, wrong=(), vocab: int = VOCAB):
        self.plain, self.n, self.block_size, self.wrong, self.vocab = (
            plain,
            num_prompt_tokens,
            block_size,
            set(wrong),
            vocab,
        )
        self.blocks = []

    def start(self):
        self.blocks = []

    def __call__(self, block, context, start):
        assert context is None and block[0, 1:].eq(MASK).all()
        size = block.shape[1]
        self.blocks.append((start, size))
        logits = torch.zeros(size - 1, self.vocab)
        for k in range(1, size):
            i = start + k - self.n  # index among generated tokens
            token = self.plain[i] if i < len(self.plain) else 0
            logits[k - 1, (token + 1) % self.vocab if i in self.wrong else token] = 1.0
        return logits


def drafting(proposer, tree_size: int = 0):
    """The drafter's policy: a tree of `tree_size` candidates, or (0) one chain."""
    return TreePolicy(proposer, tree_size) if tree_size else ChainPolicy(proposer)


def expected_rounds(num_tokens: int, block_size: int, wrong=()) -> list[int]:
    """Committed tokens per round when drafts are right except at `wrong` (generated-token indices)."""
    j, rounds = 0, []
    while j + 1 < num_tokens:
        size = min(block_size, num_tokens - j)
        accepted = 0
        while accepted < size - 1 and j + accepted + 1 not in wrong:
            accepted += 1
        rounds.append(min(accepted + 1, num_tokens - 1 - j))
        j += rounds[-1]
    return rounds


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; two threads thrash when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=ARCHS)
def setup(request):
    target = tiny_target(request.param)
    prompts = random_prompts(20)
    favourite = favourite_token(target, prompts)
    drafter = tiny_drafter(target, block_size=16)
    make_agreeing(target, drafter, favourite)
    plain = [speculative_generate(target, p, max_new_tokens=32).tokens for p in prompts]  # after the change
    return target, drafter, prompts, plain


def test_plain_decoding_equals_transformers_generate(setup):
    target, _, prompts, _ = setup
    for p in prompts[:4]:
        ours = speculative_generate(target, p, max_new_tokens=24)
        ref = target.generate(p, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours.tokens == ref[0, p.shape[1] :].tolist()
        assert ours.acceptance_lengths == [1] * 23 and ours.tau == 1.0


@pytest.mark.parametrize("block_size", [1, 2, 8, 16])
def test_greedy_lossless_with_drafter(setup, block_size):
    target, drafter, prompts, plain = setup
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    accepted = []
    for p, expected in zip(prompts, plain):
        spec = speculative_generate(target, p, ChainPolicy(proposer, block_size), max_new_tokens=32)
        assert spec.tokens == expected
        assert sum(spec.acceptance_lengths) == len(spec.tokens) - 1
        assert max(spec.acceptance_lengths) <= block_size
        if block_size > 1:  # the drafter cache holds the context K/V of the tokens verified before the last round
            assert proposer.cache.length == p.shape[1] + sum(spec.acceptance_lengths[:-1])
        accepted += spec.acceptance_lengths
    if block_size == 1:
        assert set(accepted) == {1}
    else:  # the agreeing drafter gets runs accepted: the test covers multi-token commits
        assert max(accepted) == block_size if block_size == 2 else max(accepted) > 2


@pytest.fixture(scope="module")
def chained(setup):
    """The drafter's chain rounds without a cutoff on every prompt (the whole block verified), for the cutoffs."""
    target, drafter, prompts, _ = setup
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    return [speculative_generate(target, p, ChainPolicy(proposer), max_new_tokens=32) for p in prompts]


@pytest.mark.parametrize("cutoff", [1e-4, 0.05])  # the tiny drafter is unsure: 0.05 verifies no draft
def test_draft_cutoff_verifies_a_confident_prefix_and_stays_lossless(setup, chained, cutoff):
    target, drafter, prompts, plain = setup
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    full = chained
    cut = [speculative_generate(target, p, ChainPolicy(proposer, cutoff=cutoff), max_new_tokens=32) for p in prompts]
    assert [g.tokens for g in cut] == plain
    verified = [v for g in cut for v in g.verified_drafts]
    assert all(a <= v + 1 for g in cut for a, v in zip(g.acceptance_lengths, g.verified_drafts))
    assert sum(verified) < sum(v for g in full for v in g.verified_drafts)
    assert all(g.verified_drafts[0] == 15 for g in full)  # without a cutoff the whole block is verified
    if cutoff < 1e-3:  # confident drafts still get verified and accepted
        assert max(a for g in cut for a in g.acceptance_lengths) > 1
    else:  # no draft verified: every round is a plain step
        assert set(verified) == {0}
    with pytest.raises(ValueError, match="draft_cutoff"):
        ChainPolicy(proposer, cutoff=1.5)


@pytest.mark.parametrize("block_size", [2, 5, 8, 16])
def test_commit_logic_with_oracle_drafts(block_size):
    target = tiny_target("qwen3", seed=3)
    for p, wrong in zip(random_prompts(4, seed=5), [(), (1, 2, 9), (4, 5, 6, 20), tuple(range(1, 40, 3))]):
        plain = speculative_generate(target, p, max_new_tokens=40).tokens
        oracle = OracleProposer(plain, p.shape[1], block_size, wrong)
        spec = speculative_generate(target, p, ChainPolicy(oracle), max_new_tokens=40)
        assert spec.tokens == plain
        assert spec.acceptance_lengths == expected_rounds(40, block_size, wrong)
        # each block starts at the newest committed token and the last one shrinks to end at max_new_tokens
        starts = [p.shape[1] + sum(spec.acceptance_lengths[:i]) for i in range(len(spec.acceptance_lengths))]
        assert [s for s, _ in oracle.blocks] == starts
        assert [size for _, size in oracle.blocks] == [min(block_size, p.shape[1] + 40 - s) for s in starts]
    assert spec.tau > 1.0


# --- tree verification -------------------------------------------------------------------------


def test_tree_keeps_the_most_probable_paths_parents_first():
    probs = torch.tensor([[0.6, 0.25, 0.15], [0.55, 0.3, 0.15], [0.9, 0.06, 0.04]])
    tree = build_tree(probs.log(), size=6, branching=3)
    paths = []
    for j in range(1, tree.size + 1):  # node j's path of tokens, from its parents
        path, row = [], j
        while row:
            path.insert(0, int(tree.tokens[row - 1]))
            row = tree.parents[row - 1]
        paths.append(tuple(path))
        assert tree.parents[j - 1] < j and tree.depths[j - 1] == len(path)
    assert paths == [(0,), (0, 0), (0, 0, 0), (1,), (0, 1), (0, 1, 0)]  # 0.6, 0.33, 0.297, 0.25, 0.18, 0.162
    score = lambda path: float(torch.prod(torch.stack([probs[d, t] for d, t in enumerate(path)])))  # noqa: E731
    every = (
        [(a,) for a in range(3)]
        + [(a, b) for a in range(3) for b in range(3)]
        + [(a, b, c) for a in range(3) for b in range(3) for c in range(3)]
    )
    assert sorted(map(score, paths)) == sorted(map(score, every))[-6:]  # the 6 most probable candidate paths
    mask = tree_mask(tree, context=3)[0, 0].int().tolist()
    assert mask[0] == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # the root sees the context and itself
    assert mask[3] == [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]  # (0, 0, 0): root, (0,), (0, 0) and itself
    assert mask[6] == [1, 1, 1, 1, 1, 0, 0, 0, 1, 1]  # (0, 1, 0): root, (0,), (0, 1) and itself
    assert mask[4] == [1, 1, 1, 1, 0, 0, 0, 1, 0, 0]  # (1,): root and itself
    assert follow(tree, lambda row, depth: [0, 0, 0, 7][depth]) == [1, 2, 3]
    assert follow(tree, lambda row, depth: [0, 1, 0, 7][depth]) == [1, 5, 6]
    assert follow(tree, lambda row, depth: [1, 0, 5][depth]) == [4]
    logits = torch.zeros(7, 3)
    logits[[0, 4], [1, 2]] = 1.0  # the target: 1 after the root, 2 after (1,)
    path, token = greedy_path(tree, logits)
    assert path == [4] and int(token) == 2
    assert build_tree(probs.log(), size=50, branching=1).depths == (1, 2, 3)  # a chain when one token a position
    assert tree.path_probs == pytest.approx([0.6, 0.33, 0.297, 0.25, 0.18, 0.162], rel=1e-6)


class RunnerUpOracle(OracleProposer):
    """The plain continuation as the second most probable draft at the generated-token indices `wrong`."""

    def __call__(self, block, context, start):
        logits = super().__call__(block, context, start) * 10.0
        for k in range(1, block.shape[1]):
            i = start + k - self.n
            if i in self.wrong and i < len(self.plain):
                logits[k - 1, self.plain[i]] = 9.0
        return logits


@pytest.mark.parametrize("tree_size,branching", [(1, 1), (4, 2), (15, 4), (40, 3)])
def test_greedy_tree_verification_is_lossless(setup, tree_size, branching):
    target, drafter, prompts, plain = setup
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    accepted = []
    for p, expected in zip(prompts, plain):
        spec = speculative_generate(target, p, TreePolicy(proposer, tree_size, branching), max_new_tokens=32)
        assert spec.tokens == expected
        assert all(v == tree_size for v in spec.verified_drafts[:-1]) or tree_size == 40
        assert proposer.cache.length == p.shape[1] + sum(spec.acceptance_lengths[:-1])
        accepted += spec.acceptance_lengths
    assert max(accepted) > 2 if tree_size > 1 else max(accepted) <= 2


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_accepts_runner_up_drafts_and_keeps_their_cache(arch):
    """Drafts wrong at some positions but second best there: a chain stops at each, a tree walks through its
    runner-up branch (the accepted rows are then not the block's first rows: the cache keeps that path)."""
    target = tiny_target(arch, seed=3)
    for p, wrong in zip(random_prompts(3, seed=5), [(2, 9), (4, 5, 20), tuple(range(1, 40, 3))]):
        plain = speculative_generate(target, p, max_new_tokens=40).tokens
        chain = speculative_generate(
            target, p, ChainPolicy(RunnerUpOracle(plain, p.shape[1], 8, wrong)), max_new_tokens=40
        )
        tree = speculative_generate(
            target, p, TreePolicy(RunnerUpOracle(plain, p.shape[1], 8, wrong), 15, 2), max_new_tokens=40
        )
        assert chain.tokens == tree.tokens == plain
        assert chain.acceptance_lengths == expected_rounds(40, 8, wrong)
        assert len(tree.acceptance_lengths) < len(chain.acceptance_lengths)
        eos = plain[min(wrong) + 1]  # a stop token inside a runner-up path
        stopped = speculative_generate(
            target,
            p,
            TreePolicy(RunnerUpOracle(plain, p.shape[1], 8, wrong), 15, 2),
            max_new_tokens=40,
            stop_token_ids=[eos],
        )
        assert stopped.tokens == plain[: plain.index(eos) + 1] and stopped.stopped


def test_tree_arguments_are_checked(setup):
    target, drafter, prompts, _ = setup
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    with pytest.raises(ValueError, match="greedy only"):
        speculative_generate(target, prompts[0], TreePolicy(proposer, 8), max_new_tokens=4, sampling=Sampling(0.7))
    with pytest.raises(ValueError, match="tree_size"):
        TreePolicy(proposer, -1)


def test_draft_vocabulary_scores_its_words_only_and_stays_lossless(setup):
    """A draft vocabulary: the draft logits of its words are the full head's, every other word's are -inf, so only its
    words are drafted; greedy output (chain and tree) stays the plain output."""
    target, drafter, prompts, plain = setup
    head = frozen_head_from_model(target)
    vocab = torch.arange(0, VOCAB, 3)
    full, restricted = DrafterProposer(drafter, head), DrafterProposer(drafter, head, draft_vocab=vocab)
    context = torch.randn(1, 5, drafter.fc.in_features)
    block = torch.tensor([[7] + [MASK] * 15])
    for p in (full, restricted):
        p.start()
    expected, logits = full(block, context, 5), restricted(block, context, 5)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits[:, vocab], expected[:, vocab])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(logits[:, outside]).all()
    accepted = []
    for tree_size in (0, 7):
        for p, expected_tokens in zip(prompts, plain):
            spec = speculative_generate(
                target,
                p,
                TreePolicy(restricted, tree_size) if tree_size else ChainPolicy(restricted),
                max_new_tokens=32,
            )
            assert spec.tokens == expected_tokens
            accepted += spec.acceptance_lengths
    assert max(accepted) > 2  # its drafts still get accepted
    with pytest.raises(ValueError, match="draft_vocab"):
        DrafterProposer(drafter, head, draft_vocab=[3, VOCAB])
    with pytest.raises(ValueError, match="draft_vocab"):
        DrafterProposer(drafter, head, draft_vocab=[])


# --- lookup rounds -----------------------------------------------------------------------------


def test_lookup_draft_takes_the_earliest_earlier_match():
    ids = torch.tensor([1, 2, 3, 9, 1, 2, 4, 7, 1, 2])
    assert lookup_draft(ids, 2, 3).tolist() == [3, 9, 1]  # the earliest [1, 2], not the later one
    assert lookup_draft(ids, 2, 1).tolist() == [3]
    assert lookup_draft(ids, 3, 4) is None  # [7, 1, 2] did not occur before
    assert lookup_draft(torch.tensor([5, 6, 5, 6]), 2, 8).tolist() == [5, 6]  # up to the end
    assert lookup_draft(torch.tensor([4, 4]), 1, 3).tolist() == [4]
    assert lookup_draft(torch.tensor([3, 1, 2]), 2, 3) is None  # only the newest n-gram itself
    assert lookup_draft(torch.tensor([1, 2]), 2, 3) is None and lookup_draft(ids, 0, 3) is None


@pytest.mark.parametrize("tree_size", [0, 15])
def test_lookup_rounds_are_lossless_and_keep_the_drafter_context(setup, tree_size):
    """Rounds alternate between lookup drafts and the drafter; the drafter's cache must still get every verified
    token's features (its call checks that the context it is handed starts where its cache ends)."""
    target, drafter, prompts, plain = setup
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    lookups = drafted = 0
    for p, expected in zip(prompts, plain):
        spec = speculative_generate(target, p, LookupPolicy(2, 10, drafting(proposer, tree_size)), max_new_tokens=32)
        assert spec.tokens == expected
        lookups += spec.lookup_rounds
        drafted += len(spec.acceptance_lengths) - spec.lookup_rounds
    assert lookups > 0 and drafted > 0


def test_lookup_rounds_commit_long_copies_and_skip_the_drafter():
    """A target that repeats itself: lookup rounds accept many tokens without calling the drafter; where no
    n-gram repeats, the (useless) drafter runs. Without a proposer the loop is prompt lookup decoding."""
    target = tiny_target("llama", seed=5)
    p = torch.tensor([[5, 6, 7, 8, 9] * 3])
    plain = speculative_generate(target, p, max_new_tokens=40).tokens
    oracle = OracleProposer(plain, p.shape[1], 8, wrong=range(60))
    spec = speculative_generate(target, p, LookupPolicy(3, 10, ChainPolicy(oracle)), max_new_tokens=40)
    assert spec.tokens == plain
    assert len(oracle.blocks) == len(spec.acceptance_lengths) - spec.lookup_rounds and spec.lookup_rounds > 0
    assert max(spec.acceptance_lengths) > 2 and spec.tau > 2
    alone = speculative_generate(target, p, LookupPolicy(2, 10), max_new_tokens=40)
    assert alone.tokens == plain and alone.tau > 2 and max(alone.verified_drafts) <= 10
    with pytest.raises(ValueError, match="greedy only"):
        speculative_generate(target, p, LookupPolicy(3), max_new_tokens=4, sampling=Sampling(0.7))
    with pytest.raises(ValueError, match="lookup_ngram"):
        LookupPolicy(-1)


def test_rounds_name_the_policy_that_drafted_them():
    """Each round records its draft's source; a lookup round without a match falls back (here to plain steps), the
    last chain shrinks to the budget, and a chain of block size 1 drafts nothing: plain steps."""
    target = tiny_target("llama", seed=5)
    p = torch.tensor([[5, 6, 7, 8, 9] * 3])
    plain = speculative_generate(target, p, max_new_tokens=40)
    assert set(plain.sources) == {"plain"} and plain.lookup_rounds == plain.datastore_rounds == 0
    alone = speculative_generate(target, p, LookupPolicy(2, 10), max_new_tokens=40)
    assert set(alone.sources) <= {"lookup", "plain"} and alone.lookup_rounds == alone.sources.count("lookup") > 0
    assert all(v == 0 for v, s in zip(alone.verified_drafts, alone.sources) if s == "plain")
    oracle = OracleProposer(plain.tokens, p.shape[1], 4)
    chain = speculative_generate(
        target, p, ChainPolicy(oracle), max_new_tokens=6
    )  # a block of 4, then 2 positions left
    assert chain.sources == ["chain", "chain"] and chain.verified_drafts == [3, 1] and chain.tokens == plain.tokens[:6]
    single = speculative_generate(target, p, ChainPolicy(oracle, block_size=1), max_new_tokens=6)
    assert set(single.sources) == {"plain"} and single.tokens == plain.tokens[:6]
    assert len(oracle.blocks) == 2  # the chain run's two blocks: at block size 1 the drafter never ran


def test_tau_reaches_block_size_with_perfect_drafts():
    target = tiny_target("llama", seed=4)
    p = random_prompts(1, seed=9)[0]
    plain = speculative_generate(target, p, max_new_tokens=49).tokens
    spec = speculative_generate(target, p, ChainPolicy(OracleProposer(plain, p.shape[1], 16)), max_new_tokens=49)
    assert spec.tokens == plain and spec.acceptance_lengths == [16, 16, 16]
    assert len(spec.draft_s) == len(spec.verify_s) == len(spec.bookkeeping_s) == 3
    assert spec.decode_s >= sum(spec.draft_s) + sum(spec.verify_s) + sum(spec.bookkeeping_s) > 0
    assert spec.tau == 16.0 and spec.decode_tokens == 48


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13, 17])
def test_max_new_tokens_inside_a_block(max_new_tokens):
    target = tiny_target("llama", seed=2)
    p = random_prompts(1, seed=7)[0]
    plain = speculative_generate(target, p, max_new_tokens=40).tokens
    spec = speculative_generate(
        target, p, ChainPolicy(OracleProposer(plain, p.shape[1], 8)), max_new_tokens=max_new_tokens
    )
    assert spec.tokens == plain[:max_new_tokens]
    assert spec.acceptance_lengths == expected_rounds(max_new_tokens, 8)


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_inside_a_block_ends_generation_after_it(arch):
    target = tiny_target(arch, seed=6)
    for p in random_prompts(6, seed=11):
        plain = speculative_generate(target, p, max_new_tokens=40).tokens
        eos = plain[min(5, len(set(plain)) - 1)]
        cut = plain.index(eos) + 1
        stopped_plain = speculative_generate(target, p, max_new_tokens=40, stop_token_ids=[eos])
        assert stopped_plain.tokens == plain[:cut] and stopped_plain.stopped
        for wrong in [(), (cut - 1,), (cut,)]:  # EOS accepted as a draft, EOS as the bonus, EOS then garbage
            oracle = OracleProposer(plain, p.shape[1], 16, wrong)
            spec = speculative_generate(
                target, p, ChainPolicy(oracle), max_new_tokens=40, stop_token_ids=[eos, VOCAB + 5]
            )
            assert spec.tokens == plain[:cut] and spec.stopped
            assert sum(spec.acceptance_lengths) == cut - 1
    first = speculative_generate(
        target, p, ChainPolicy(OracleProposer(plain, p.shape[1], 8)), max_new_tokens=40, stop_token_ids=[plain[0]]
    )
    assert first.tokens == plain[:1] and first.acceptance_lengths == [] and first.stopped


def test_drafter_eos_matches_plain(setup):
    target, drafter, prompts, plain_outputs = setup
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    for p, plain in zip(prompts[:8], plain_outputs):
        eos = [plain[len(plain) // 3], plain[-1]]
        a = speculative_generate(target, p, max_new_tokens=32, stop_token_ids=eos)
        b = speculative_generate(target, p, ChainPolicy(proposer), max_new_tokens=32, stop_token_ids=eos)
        assert a.tokens == b.tokens and a.tokens[-1] in eos


def test_prompt_lookup_baseline_matches_plain():
    target = tiny_target("llama", seed=5)
    repetitive = torch.tensor([[5, 6, 7, 8, 9] * 3])  # lookup finds its n-grams: multi-token rounds
    for p in random_prompts(4, seed=13) + [repetitive]:
        plain = speculative_generate(target, p, max_new_tokens=40).tokens
        pld = prompt_lookup_generate(target, p, max_new_tokens=40)
        assert pld.tokens == plain
        assert pld.decode_tokens + 1 <= len(plain) and all(a >= 1 for a in pld.acceptance_lengths)
        eos = plain[12]
        stopped = prompt_lookup_generate(target, p, max_new_tokens=40, stop_token_ids=[eos])
        assert stopped.tokens == plain[: plain.index(eos) + 1] and stopped.stopped
    assert pld.tau > 2  # the repetitive prompt


def test_bad_arguments_are_named():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="block_size"):
        ChainPolicy(OracleProposer([], 3, 4), block_size=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, [1, 2, 3], max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        speculative_generate(target, [1, 2, 3], max_new_tokens=4, sampling=Sampling(1.0, top_p=0.0))
    with pytest.raises(ValueError, match="empty prompt"):
        speculative_generate(target, [], max_new_tokens=4)


# --- fidelity to the reference implementation --------------------------------------------------


@pytest.fixture
def reference(monkeypatch):
    dflash_model = pytest.importorskip("dflash.model")
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # it calls torch.cuda.synchronize
    return dflash_model


@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_reference_dflash_generate(setup, reference, tmp_path, block_size):
    target, drafter, prompts, plain_outputs = setup
    drafter.save_pretrained(tmp_path / "drafter")
    ref_drafter = reference.DFlashDraftModel.from_pretrained(tmp_path / "drafter").eval()
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    histogram = set()
    for i, (p, plain) in enumerate(zip(prompts[:10], plain_outputs)):
        stop = [plain[20]] if i % 2 else None  # half of them stop on a token the target emits
        ref = reference.dflash_generate(ref_drafter, target, p, 40, stop, block_size=block_size, return_stats=True)
        ours = speculative_generate(
            target, p, ChainPolicy(proposer, block_size), max_new_tokens=40, stop_token_ids=stop or ()
        )
        assert ours.tokens == ref.output_ids[0, p.shape[1] :].tolist()
        assert ours.acceptance_lengths == ref.acceptance_lengths
        histogram.update(ours.acceptance_lengths)
    assert len(histogram) >= 2 and max(histogram) > 2  # the comparison covers multi-token commits


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 20)])
def test_sampling_matches_reference_with_the_same_seed(setup, reference, tmp_path, top_p, top_k):
    """With the global RNG seeded alike, the reference's rejection sampling and ours draw the same
    random numbers in the same order, so the sampled outputs agree token for token."""
    target, drafter, prompts, _ = setup
    drafter.save_pretrained(tmp_path / "drafter")
    ref_drafter = reference.DFlashDraftModel.from_pretrained(tmp_path / "drafter").eval()
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    for seed, p in enumerate(prompts[:6]):
        torch.manual_seed(seed)
        ref = reference.dflash_generate(
            ref_drafter, target, p, 32, None, 0.8, top_p, top_k, block_size=8, return_stats=True
        )
        torch.manual_seed(seed)
        ours = speculative_generate(
            target, p, ChainPolicy(proposer, 8), max_new_tokens=32, sampling=Sampling(0.8, top_p, top_k)
        )
        assert ours.tokens == ref.output_ids[0, p.shape[1] :].tolist()
        assert ours.acceptance_lengths == ref.acceptance_lengths


@pytest.mark.parametrize("kernel_from", [1, 2, 4, 16])
def test_exact_base_rows_is_the_fewest_rows_whose_kernel_every_longer_tile_shares(kernel_from):
    """A GEMM whose rows come out with other bits below `kernel_from` rows (as a 1-row bf16 GEMM does on Intel AMX):
    short tiles must be padded to exactly that many rows; where one kernel serves every count, to none."""

    def linear(x, w, b=None):  # one row at a time (the same bits whatever the companions), shifted below the threshold
        out = torch.stack([torch.nn.functional.linear(r[None], w, b)[0] for r in x])
        return out + 1e-3 if x.shape[0] < kernel_from else out

    assert exact_base_rows(torch.empty(24, 40), bias=True, tile=16, linear=linear) == kernel_from
    # tiles of up to 8 rows never reach a kernel from 16 rows on: one kernel serves them all
    assert exact_base_rows(torch.empty(24, 40), bias=False, tile=8, linear=linear) == (
        kernel_from if kernel_from <= 8 else 1
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probed_padding_gives_the_logits_of_16_row_tiles(dtype):
    """Padding a tile only to the rows its probe asks for changes no bit: a one-token step and a verify forward
    of every length up to a tile give the logits of the target whose every tile is padded to 16 rows."""
    probed = make_verification_exact(tiny_target("qwen3").to(dtype))
    fixed = make_verification_exact(tiny_target("qwen3").to(dtype))
    for m in fixed.modules():  # every short tile padded to the full 16 rows
        if hasattr(m, "_exact_base"):
            m._exact_base = m._exact_base[0], 16
    assert {m._exact_base[1] for m in fixed.modules() if hasattr(m, "_exact_base")} == {16}
    ids = torch.randint(0, VOCAB - 2, (1, 120), generator=torch.Generator().manual_seed(6))
    for rows in (1, 2, 3, 5, 8, 13, 16):
        logits = []
        for model in (probed, fixed):
            cache = model(ids[:, :100], use_cache=True).past_key_values
            logits.append(model(ids[:, 100 : 100 + rows], past_key_values=cache, use_cache=True).logits)
        assert torch.equal(*logits), rows


@pytest.mark.parametrize(
    "dtype,fp32_attention", [(torch.float32, None), (torch.bfloat16, False), (torch.bfloat16, True)]
)
@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_is_lossless_with_exact_verification(arch, dtype, fp32_attention):
    """CPU, fp32 and bf16 (with bf16 or fp32 attention): made exact as the harness makes it (row-padded GEMMs,
    row-wise attention), a block forward gives the logits of one-token forwards bit for bit at every context
    length, so speculative output equals plain decoding token for token."""
    target = make_verification_exact(tiny_target(arch).to(dtype), rows=16, fp32_attention=fp32_attention)
    attention = EXACT_ATTENTION_FP32 if fp32_attention and dtype != torch.float32 else EXACT_ATTENTION
    assert needs_exact_verification(dtype, "cpu") and target.config._attn_implementation == attention
    ids = torch.randint(0, VOCAB - 2, (1, 200), generator=torch.Generator().manual_seed(3))
    for start in range(70, 184, 3):
        out = target(ids[:, :start], use_cache=True)
        block = target(ids[:, start : start + 16], past_key_values=out.past_key_values, use_cache=True).logits[0]
        out.past_key_values.crop(-16)
        steps = [
            target(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
            for t in range(start, start + 16)
        ]
        assert torch.equal(block, torch.stack(steps)), start
    # a prefill longer than a tile (prompt lookup verifies candidates inside it) gives the one-token logits too
    prefill = target(ids[:, :45], use_cache=True).logits[0]
    out = target(ids[:, :1], use_cache=True)
    steps = [out.logits[0, -1]] + [
        target(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
        for t in range(1, 45)
    ]
    assert torch.equal(prefill, torch.stack(steps))
    # a tree verify: each row gives the logits of one-token forwards along its own path (one forward a node: each
    # row's path steps on from a copy of its parent's cache, the cache the prefill and the steps to the parent left)
    g = torch.Generator().manual_seed(4)
    for start in range(70, 184, 19):
        tree = build_tree(torch.randn(7, VOCAB, generator=g) * 3, size=15, branching=3)
        out = target(ids[:, :start], use_cache=True)
        prefilled = copy.deepcopy(out.past_key_values)
        rows = target(
            torch.cat([ids[:, start : start + 1], tree.tokens[None]], dim=1),
            past_key_values=out.past_key_values,
            position_ids=start + torch.tensor([[0, *tree.depths]]),
            attention_mask=tree_mask(tree, start),
            use_cache=True,
        ).logits[0]
        caches = {}  # row -> the cache after its one-token step (row 0: the last committed token's)
        for row in range(tree.size + 1):  # parents come before their children
            cache = caches[tree.parents[row - 1]] if row else prefilled
            token = int(tree.tokens[row - 1]) if row else int(ids[0, start])
            caches[row] = copy.deepcopy(cache)
            step = target(torch.tensor([[token]]), past_key_values=caches[row], use_cache=True)
            assert torch.equal(rows[row], step.logits[0, -1]), (start, row)
    drafter = tiny_drafter(tiny_target(arch), block_size=8).to(dtype)
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    for p in random_prompts(6, seed=5):
        plain = speculative_generate(target, p, max_new_tokens=24).tokens
        assert speculative_generate(target, p, ChainPolicy(proposer), max_new_tokens=24).tokens == plain
        assert speculative_generate(target, p, TreePolicy(proposer, 15), max_new_tokens=24).tokens == plain
        assert prompt_lookup_generate(target, p, max_new_tokens=24, num_lookup_tokens=4, pad_token_id=0).tokens == plain


@pytest.mark.skipif(not cpu_has_fast_bf16(), reason="bf16 serving is chosen by dtype=auto only on CPUs with fast bf16")
def test_prompt_lookup_equals_plain_on_smollm2_in_bf16():
    """The embedded target in bf16 on a prompt where transformers' prompt lookup, which verifies its first
    candidates inside the prefill, once left plain output at token 11 (a prefill-sized GEMM vs 16-row tiles)."""
    from flashdraft.target import EMBEDDED_NAME, load_target, stop_token_ids
    from harness.evaluate import build_prompts

    target, tokenizer = load_target(EMBEDDED_NAME, dtype=torch.bfloat16)
    make_verification_exact(target, rows=16)
    prompt = next(p for p in build_prompts(tokenizer, ["humaneval"], split="heldout") if p.record_id == "HumanEval/130")
    stop = stop_token_ids(target, tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the harness runs on two cores (one thread takes other GEMM kernels)
    try:  # 16 tokens hold token 11 (64 took minutes on a loaded 2-core machine)
        plain = speculative_generate(target, prompt.input_ids, max_new_tokens=16, stop_token_ids=stop).tokens
        lookup = prompt_lookup_generate(
            target, prompt.input_ids, max_new_tokens=16, stop_token_ids=stop, num_lookup_tokens=10
        )
    finally:
        torch.set_num_threads(threads)
    assert lookup.tokens == plain
