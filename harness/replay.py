"""Served-order replay: the served loop's rounds, run offline on a feature store's stored responses.

The trainer's offline tau anchors blocks at random response positions; a served round starts wherever
the previous one stopped. Replay walks each stored response as the harness would serve it greedily, with the
same draft policy (`harness.policies`) — the first block starts at the first response token, context features
are the stored ones, and each round advances by the accepted drafts plus one — without running the target.
Replay tau equals the served tau exactly when the stored responses are the served output and the stored features
are the served ones; so offline vs replay isolates where blocks start, replay vs served isolates numerics and
responses that differ from the stored ones.
"""

from __future__ import annotations

import torch

from flashdraft.store import StoreError, StoreReader
from harness.acceptance import GREEDY
from harness.tree import follow


def _accepted(draft, truth: torch.Tensor) -> int:
    """How many of the draft's tokens the stored response `truth` accepts (a tree: the longest path it follows)."""
    if draft.tree is not None:
        truth = truth.tolist()
        return len(follow(draft.tree, lambda row, depth: truth[depth] if depth < len(truth) else -1))
    drafts = draft.tokens[0, 1:][: len(truth)]
    wrong = (drafts != truth).nonzero()
    return int(wrong[0, 0]) if len(wrong) else len(truth)


@torch.inference_mode()
def replay_acceptance(
    policy,
    store: StoreReader,
    seq_id: str,
    *,
    max_new_tokens: int,
    verified: list | None = None,
    sources: list | None = None,
) -> list[int]:
    """Committed tokens per round when the stored response of `seq_id` is served greedily by `policy` with at
    most `max_new_tokens` new tokens, as `speculative_generate` counts them. `verified` and `sources`, if given,
    get the drafts verified and the round's draft source (`Draft.source`) appended, a round at a time."""
    if store.projected and policy.layer_ids is not None:
        raise StoreError(
            f"{store.path} is a projected store: served-order replay feeds the exported drafter the raw features it "
            "reads when served; replay on the raw store the projected one was made from"
        )
    seq = store.read(store.index(seq_id), layers=policy.layer_ids)
    response = seq.loss_mask.nonzero()[0]
    if len(response) == 0:
        return []
    features = device = None
    if policy.layer_ids is not None:
        head = policy.proposer.head.lm_head.weight  # the drafter's dtype and device
        device, features = head.device, seq.features.to(device=head.device, dtype=head.dtype)[None]
    ids = torch.as_tensor(seq.input_ids).to(device)
    first = int(response[0])  # the token the prefill emits: the first block starts there
    limit = first + max_new_tokens  # served blocks shrink only here, not at the stop token
    end = min(len(ids), limit)
    policy.start()
    lengths, start, context_from = [], first, 0
    while start + 1 < end:
        context = features[:, context_from:start] if features is not None else None
        draft = policy.draft(ids, start, limit - start, context, GREEDY)
        if draft.took_context:
            context_from = start
        produced = min(_accepted(draft, ids[start + 1 : min(start + draft.tokens.shape[1], end)]) + 1, end - start - 1)
        lengths.append(produced)
        if verified is not None:
            verified.append(draft.tokens.shape[1] - 1)
        if sources is not None:
            sources.append(draft.source)
        start += produced
    return lengths


def replay_tau(policy, store_path, seq_ids, *, max_new_tokens: int) -> dict | None:
    """Replay over the eval prompts found in the store: {"tau", "prompts", "missing"}; None when none is there."""
    store = StoreReader(store_path)
    present = set(store.seq_ids)
    found = [s for s in seq_ids if s in present]
    if not found:
        return None
    rounds = [n for s in found for n in replay_acceptance(policy, store, s, max_new_tokens=max_new_tokens)]
    return {
        "tau": sum(rounds) / len(rounds) if rounds else None,
        "prompts": len(found),
        "missing": len(seq_ids) - len(found),
    }
