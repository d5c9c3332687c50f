"""Served-order replay: on a store holding exactly the served responses and their features, replaying the
rounds offline gives the served acceptance lengths round for round (with and without a draft cutoff, and with
tree verification)."""

import pytest
import torch

from flashdraft.store import write_store
from flashdraft.target import capture_features, frozen_head_from_model
from harness.drafter import DrafterProposer
from harness.policies import ChainPolicy, DatastorePolicy, LookupPolicy, TreePolicy
from harness.replay import replay_acceptance, replay_tau
from harness.speculative import speculative_generate
from tests.test_speculative import favourite_token, make_agreeing, random_prompts, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def served_store(tmp_path_factory):
    torch.set_num_threads(1)
    target = tiny_target("qwen3", layers=10, seed=2)  # 10 layers: 5 distinct feature layers
    prompts = random_prompts(6, seed=11)
    drafter = tiny_drafter(target, block_size=8)
    make_agreeing(target, drafter, favourite_token(target, prompts))
    proposer = DrafterProposer(drafter, frozen_head_from_model(target))
    sequences, served = [], {}
    for k, p in enumerate(prompts):
        plain = speculative_generate(target, p, max_new_tokens=40).tokens
        ids = torch.cat([p[0], torch.tensor(plain)])
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[p.shape[1] :] = True
        features = capture_features(target, ids[None], drafter.target_layer_ids)[0]
        sequences.append({"seq_id": f"s{k}", "input_ids": ids.numpy(), "loss_mask": mask.numpy(), "features": features})
        served[f"s{k}"] = p
    path = tmp_path_factory.mktemp("replay") / "store"
    write_store(
        path, sequences, layer_ids=drafter.target_layer_ids, hidden_size=target.config.hidden_size, dtype="float32"
    )
    return target, proposer, path, served


@pytest.mark.parametrize(
    "cutoff,tree_size,lookup,datastore",
    [
        (0.0, 0, 0, False),
        (1e-4, 0, 0, False),
        (0.0, 12, 0, False),
        (0.0, 0, 2, False),
        (0.0, 12, 2, False),
        (0.0, 12, 3, True),
    ],
)
def test_replay_gives_the_served_rounds(served_store, cutoff, tree_size, lookup, datastore):
    from flashdraft.store import StoreReader
    from harness.datastore import Datastore

    target, proposer, path, served = served_store
    store = StoreReader(path)
    multi = lookups = from_datastore = 0
    drafting = TreePolicy(proposer, tree_size) if tree_size else ChainPolicy(proposer, cutoff=cutoff)
    for seq_id, p in served.items():
        # a datastore of the other responses: its drafts are partly right, as served against a training store
        data = Datastore.from_store(path, exclude=[seq_id], ngram=2, min_count=1) if datastore else None
        for max_new in (40, 17):
            policy = DatastorePolicy(data, 5, drafting) if data else drafting
            policy = LookupPolicy(lookup, 5, policy) if lookup else policy
            live = speculative_generate(target, p, policy, max_new_tokens=max_new)
            sources = []
            replayed = replay_acceptance(policy, store, seq_id, max_new_tokens=max_new, sources=sources)
            assert replayed == live.acceptance_lengths, (seq_id, max_new)
            assert sources == live.sources
            multi += max(live.acceptance_lengths) > 1
            lookups += live.lookup_rounds
            from_datastore += live.datastore_rounds
    assert multi  # the agreeing drafter gets drafts accepted, so the rounds are not all single tokens
    assert lookups > 0 if lookup else lookups == 0
    assert from_datastore > 0 if datastore else from_datastore == 0
    summary = replay_tau(drafting, path, [*served, "absent"], max_new_tokens=40)
    assert summary["prompts"] == len(served) and summary["missing"] == 1 and summary["tau"] > 1.0
    assert replay_tau(drafting, path, ["absent"], max_new_tokens=40) is None
