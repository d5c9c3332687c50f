"""Served-order replay: the served loop's rounds, run offline on a feature store's stored responses.

The trainer's offline tau anchors blocks at random response positions; a served round starts wherever
the previous one stopped. Replay walks each stored response as the harness would serve it greedily —
the first block starts at the first response token, context features are the stored ones, and each
round advances by the accepted drafts plus one — without running the target. Replay tau equals the
served tau exactly when the stored responses are the served output and the stored features are the
served ones; so offline vs replay isolates where blocks start, replay vs served isolates numerics and
responses that differ from the stored ones.
"""

from __future__ import annotations

import torch

from flashdraft.store import StoreReader
from harness.lookup import draft_without_drafter
from harness.speculative import verified_prefix
from harness.tree import build_tree, follow


@torch.inference_mode()
def replay_acceptance(proposer, store: StoreReader, seq_id: str, *, max_new_tokens: int, draft_cutoff: float = 0.0,
                      tree_size: int = 0, tree_branching: int = 4, lookup_ngram: int = 0, lookup_tokens: int = 10,
                      datastore=None, verified: list | None = None, lookups: list | None = None) -> list[int]:
    """Committed tokens per round when the stored response of `seq_id` is served greedily by `proposer`
    (a DrafterProposer) with at most `max_new_tokens` new tokens, as `speculative_generate` counts them
    (with `tree_size` > 0: a tree of that many candidates verified a round; with `lookup_ngram` > 0, lookup rounds
    where the newest n-gram occurred before; with a `datastore`, its rounds where there was none). `verified` and `lookups`, if given, get the drafts verified and
    whether it was a lookup round appended, a round at a time."""
    seq = store.read(store.index(seq_id), layers=proposer.layer_ids)
    ids = torch.as_tensor(seq.input_ids)
    response = seq.loss_mask.nonzero()[0]
    if len(response) == 0:
        return []
    device, dtype = proposer.head.lm_head.weight.device, proposer.head.lm_head.weight.dtype
    features = seq.features.to(device=device, dtype=dtype)[None]
    first = int(response[0])  # the token the prefill emits: the first block starts there
    limit = first + max_new_tokens  # served blocks shrink only here, not at the stop token
    end = min(len(ids), limit)
    proposer.start()
    lengths, start, context_from = [], first, 0
    while start + 1 < end:
        found, _ = draft_without_drafter(ids[: start + 1], min(lookup_tokens, limit - start - 1), lookup_ngram=lookup_ngram,
                                         datastore=datastore)  # fmt: skip
        if found is None:
            size = min(proposer.block_size, limit - start)
            block = torch.full((1, size), proposer.mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = ids[start]
            logits = proposer(block, features[:, context_from:start], start)
            context_from = start
            if draft_cutoff > 0:
                size = 1 + verified_prefix(logits, draft_cutoff)
        else:
            size = 1 + len(found)
        truth = ids[start + 1 : min(start + size, end)]
        if found is None and tree_size:
            tree = build_tree(logits, tree_size, tree_branching)
            accepted = len(follow(tree, lambda row, depth: truth[depth] if depth < len(truth) else -1))
            size = 1 + tree.size
        else:  # a chain: the lookup draft or the drafter's top tokens
            drafts = (found if found is not None else logits.argmax(dim=-1).cpu())[: len(truth)]
            wrong = (drafts != truth).nonzero()
            accepted = int(wrong[0, 0]) if len(wrong) else len(truth)
        produced = min(accepted + 1, end - start - 1)
        lengths.append(produced)
        if verified is not None:
            verified.append(size - 1)
        if lookups is not None:
            lookups.append(found is not None)
        start += produced
    return lengths


def replay_tau(proposer, store_path, seq_ids, *, max_new_tokens: int, draft_cutoff: float = 0.0, tree_size: int = 0,
               tree_branching: int = 4, lookup_ngram: int = 0, lookup_tokens: int = 10, datastore=None) -> dict | None:
    """Replay over the eval prompts found in the store: {"tau", "prompts", "missing"}; None when none is there."""
    store = StoreReader(store_path)
    present = set(store.seq_ids)
    found = [s for s in seq_ids if s in present]
    if not found:
        return None
    rounds = [n for s in found for n in replay_acceptance(proposer, store, s, max_new_tokens=max_new_tokens, draft_cutoff=draft_cutoff,
                                                          tree_size=tree_size, tree_branching=tree_branching,
                                                          lookup_ngram=lookup_ngram, lookup_tokens=lookup_tokens, datastore=datastore)]  # fmt: skip
    return {"tau": sum(rounds) / len(rounds) if rounds else None, "prompts": len(found), "missing": len(seq_ids) - len(found)}
