"""Datastore drafts: the table keeps the confident continuations of response tokens only, drafts follow it
greedily, the store it is built from leaves the named sequences out, and rounds that verify its drafts keep
the output equal to plain greedy decoding whether its drafts are right or wrong."""

import pytest
import torch

from flashdraft.store import write_store
from flashdraft.target import frozen_head_from_model
from harness.acceptance import Sampling
from harness.datastore import Datastore
from harness.drafter import DrafterProposer
from harness.policies import ChainPolicy, DatastorePolicy, LookupPolicy
from harness.speculative import speculative_generate
from tests.test_speculative import VOCAB, OracleProposer, drafting, one_thread, setup, tiny_target  # noqa: F401  (fixtures)


def pair(ids, prompt_len):
    ids = torch.as_tensor(ids)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[prompt_len:] = True
    return ids.numpy(), mask.numpy()


def test_table_keeps_confident_continuations_of_response_tokens():
    seqs = [pair([1, 2, 3, 1, 2, 4, 1, 2, 3], 2), pair([7, 8, 9], 3)]  # the second is all prompt: nothing to predict
    confident = Datastore(seqs, ngram=2, min_count=2)
    assert confident.next_token == {(1, 2): 3} and confident.sequences == 1 and confident.tokens == 7
    assert confident.draft(torch.tensor([9, 1, 2]), 5).tolist() == [3]  # (2, 3) followed once only: the draft stops
    every = Datastore(seqs, ngram=2, min_count=1)
    assert every.draft(torch.tensor([9, 1, 2]), 5).tolist() == [3, 1, 2, 3, 1]  # greedily through the table
    assert every.draft(torch.tensor([9, 1, 2]), 2).tolist() == [3, 1]
    assert every.draft(torch.tensor([2, 4]), 3).tolist() == [1, 2, 3]
    assert (8, 9) not in every.next_token  # prompt tokens are keys, never predictions
    assert every.draft(torch.tensor([5, 5]), 3) is None and every.draft(torch.tensor([2]), 3) is None
    shy = Datastore(seqs, ngram=2, min_count=1, min_share=0.7)  # (1, 2) -> 3 in 2 of 3 cases only
    assert (1, 2) not in shy.next_token and shy.next_token[(2, 3)] == 1
    prefix = Datastore([pair([5, 6, 7, 8], 2)], ngram=3, min_count=1)  # keys may reach into the prompt
    assert prefix.next_token == {(5, 6, 7): 8}
    backoff = Datastore(seqs[:1], ngram=3, min_ngram=2, min_count=1)  # (9, 1, 2) never occurred: (1, 2) drafts instead
    assert Datastore(seqs[:1], ngram=3, min_count=1).draft(torch.tensor([9, 1, 2]), 4) is None
    assert backoff.draft(torch.tensor([9, 1, 2]), 4).tolist() == [
        4,
        1,
        2,
        3,
    ]  # then the 3-grams (1, 2, 4), (2, 4, 1), ...
    with pytest.raises(ValueError, match="ngram"):
        Datastore(seqs, ngram=0)
    with pytest.raises(ValueError, match="min_ngram"):
        Datastore(seqs, ngram=2, min_ngram=3)


def test_from_store_leaves_the_named_sequences_out(tmp_path):
    sequences = []
    for k, ids in enumerate([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5]]):
        ids, mask = pair(ids, 2)
        sequences.append({"seq_id": f"s{k}", "input_ids": ids, "loss_mask": mask, "features": torch.zeros(len(ids), 4)})
    write_store(tmp_path / "store", sequences, layer_ids=[0], hidden_size=4, dtype="float32")
    every = Datastore.from_store(tmp_path / "store", ngram=2, min_count=1)
    assert every.sequences == 3 and every.excluded == 0 and every.next_token[(2, 3)] == 5  # 5 twice, 4 once
    left_out = Datastore.from_store(tmp_path / "store", exclude=["s1", "s2", "absent"], ngram=2, min_count=1)
    assert left_out.sequences == 1 and left_out.excluded == 2 and left_out.next_token[(2, 3)] == 4
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Datastore.from_store(tmp_path / "nowhere")


@pytest.mark.parametrize("tree_size", [0, 15])
def test_datastore_rounds_are_lossless_right_or_wrong(setup, tree_size):  # noqa: F811
    """Datastore drafts from the plain outputs (mostly right) and from shifted ones (mostly wrong), mixed with
    lookup and drafter rounds: the output stays plain greedy's, and the drafter's cache stays whole."""
    target, drafter, prompts, plain = setup
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    right = Datastore(
        [pair(torch.cat([p[0], torch.tensor(t)]), p.shape[1]) for p, t in zip(prompts[:10], plain[:10])],
        ngram=3,
        min_count=1,
    )
    wrong = Datastore(
        [pair(torch.cat([p[0], (torch.tensor(t) + 1) % VOCAB]), p.shape[1]) for p, t in zip(prompts, plain)],
        ngram=2,
        min_count=1,
    )
    for datastore in (right, wrong):
        rounds = drafted = 0
        for p, expected in zip(prompts, plain):
            policy = LookupPolicy(3, 10, DatastorePolicy(datastore, 10, drafting(proposer, tree_size)))
            spec = speculative_generate(target, p, policy, max_new_tokens=32)
            assert spec.tokens == expected
            assert spec.datastore_rounds <= spec.lookup_rounds <= len(spec.acceptance_lengths)
            rounds += spec.datastore_rounds
            drafted += len(spec.acceptance_lengths) - spec.lookup_rounds
        assert rounds > 0 and drafted > 0


def test_datastore_of_the_same_response_commits_it_without_the_drafter():
    """A datastore that holds this prompt's own plain output: its drafts are right, the wrong drafter runs only in
    the rounds the datastore has nothing for, and greedy is refused at temperature > 0."""
    target = tiny_target("qwen3", seed=3)
    p = torch.randint(1, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = speculative_generate(target, p, max_new_tokens=40).tokens
    datastore = Datastore([pair(torch.cat([p[0], torch.tensor(plain)]), p.shape[1])], ngram=3, min_count=1)
    oracle = OracleProposer(plain, p.shape[1], 8, wrong=range(60))
    spec = speculative_generate(target, p, DatastorePolicy(datastore, 10, ChainPolicy(oracle)), max_new_tokens=40)
    assert spec.tokens == plain
    assert (
        spec.datastore_rounds == spec.lookup_rounds > 0
        and len(oracle.blocks) == len(spec.acceptance_lengths) - spec.datastore_rounds
    )
    assert spec.tau > 4 and max(spec.acceptance_lengths) == 11
    with pytest.raises(ValueError, match="greedy only"):
        speculative_generate(target, p, DatastorePolicy(datastore), max_new_tokens=4, sampling=Sampling(0.7))
