"""Chain vs tree verification for a trained drafter: served-order replay tau and verify cost, one run.

    .venv/bin/python benchmarks/bench_tree.py --drafter runs/full-smollm2-135m/drafter
        --store runs/full-smollm2-135m/features [--sequences 60] [--max-new-tokens 256]
        [--trees 3x2 7x2 7x4 11x4 15x4 15x8] [--cutoffs 0 0.1] [--lookups 2 3] [--datastores 4:2 6:2]
        [--draft-vocabs 0 8192] [--replay-only]

Part 1 replays the served greedy rounds offline (`harness/replay.py`) on `--sequences` stored responses
of `--store`, for a chain (each cutoff), for each tree (size x branching) and for `dflash_lookup` with the
first tree and each `--lookups` n-gram size (lookup rounds of up to `--lookup-tokens`), and for `dflash_datastore`
with the first tree, the last lookup size and each `--datastores` n-gram:min_count (a `harness.datastore.Datastore`
built from `--datastore-store`, default `--store`, with the replayed sequences left out): tau without the target.
Part 2 times, on the embedded SmolLM2 target in the harness's dtype with exact verification and a cache
of ~300 tokens, one plain decode step, one draft (its cache holding all but the 2 newest context tokens,
as in a served round), and one verify forward of each shape (a chain of as many drafts as the replay
verified on average, or a tree of that size from real draft logits), interleaved. Printed per setting: replay tau,
rows verified, the round cost in plain steps and the speedup it predicts (tau x plain step / round; for lookup
settings the mean over its tree rounds, draft + tree verify, and its lookup rounds, a chain verify of the mean
lookup rows and no draft).
With `--draft-vocabs`, every setting is replayed and the draft timed for each draft vocabulary (0: all words; K: the
K most frequent response tokens of `--datastore-store`, `flashdraft.vocab`, the replayed sequences left out).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from flashdraft.model import DFlashDrafter
from flashdraft.store import StoreReader
from flashdraft.target import (
    frozen_head_from_model,
    load_target,
    make_verification_exact,
    needs_exact_verification,
    resolve_dtype,
)
from flashdraft.vocab import frequent_tokens
from harness.datastore import Datastore
from harness.drafter import DrafterProposer
from harness.policies import ChainPolicy, DatastorePolicy, LookupPolicy, TreePolicy
from harness.replay import replay_acceptance
from harness.tree import build_tree, tree_mask


def replayed_policy(setting, proposer, datastores: dict, lookup_tokens: int):
    """The draft policy a setting (kind, cutoff, tree size, branching, lookup n-gram, datastore) serves with."""
    kind, cutoff, size, branching, ngram, datastore = setting
    if kind == "chain":
        return ChainPolicy(proposer, cutoff=cutoff)
    policy = TreePolicy(proposer, size, branching)
    if datastore:
        policy = DatastorePolicy(datastores[datastore], lookup_tokens, policy)
    return LookupPolicy(ngram, lookup_tokens, policy) if ngram else policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--store", required=True, help="a feature store whose responses the replay walks")
    ap.add_argument("--sequences", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument(
        "--trees", nargs="+", default=["3x2", "7x2", "7x4", "11x4", "15x4", "15x8"], help="size x branching"
    )
    ap.add_argument("--cutoffs", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument(
        "--lookups", type=int, nargs="*", default=[2, 3], help="dflash_lookup n-gram sizes (with the first tree)"
    )
    ap.add_argument("--lookup-tokens", type=int, default=10)
    ap.add_argument(
        "--datastores",
        nargs="*",
        default=[],
        help="dflash_datastore settings, n-gram:min_count or n-gram-min_ngram:min_count "
        "(with the first tree and last lookup)",
    )
    ap.add_argument("--datastore-store", default=None, help="the store the datastore is built from (default: --store)")
    ap.add_argument("--draft-vocabs", type=int, nargs="+", default=[0], help="draft vocabulary sizes (0: all words)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--replay-only", action="store_true", help="part 1 only: the replay taus, no timing")
    args = ap.parse_args()
    dtype = resolve_dtype(args.dtype, "cpu")
    target, _ = load_target("smollm2-135m", dtype=dtype)
    if needs_exact_verification(dtype, "cpu"):
        make_verification_exact(target)
    drafter = DFlashDrafter.from_pretrained(args.drafter, dtype=dtype)
    store = StoreReader(args.store)
    seq_ids = store.seq_ids[:: max(1, len(store.seq_ids) // args.sequences)][: args.sequences]
    head, vocab_size = frozen_head_from_model(target), target.config.vocab_size
    responses = (
        list(StoreReader(args.datastore_store or args.store).token_sequences(skip=seq_ids))
        if any(args.draft_vocabs)
        else []
    )
    proposers = {
        k: DrafterProposer(drafter, head, frequent_tokens(responses, k, vocab_size) if k else None)
        for k in args.draft_vocabs
    }
    proposer = proposers[args.draft_vocabs[0]]
    trees = [tuple(int(x) for x in t.split("x")) for t in args.trees]
    # (kind, cutoff, tree size, branching, lookup n-gram, datastore "n-gram:min_count" or "")
    settings = [("chain", c, 0, 0, 0, "") for c in args.cutoffs] + [("tree", 0.0, n, b, 0, "") for n, b in trees]
    lookup_settings = [("lookup", 0.0, *trees[0], ngram, "") for ngram in args.lookups]
    lookup_settings += [("lookup", 0.0, *trees[0], args.lookups[-1] if args.lookups else 0, d) for d in args.datastores]
    datastores = {}
    for d in args.datastores:
        orders, min_count = d.split(":")  # "4:1", or "4-3:2" for 4-grams backing off to 3-grams
        ngram, _, min_ngram = orders.partition("-")
        datastores[d] = Datastore.from_store(
            args.datastore_store or args.store,
            exclude=seq_ids,
            ngram=int(ngram),
            min_ngram=int(min_ngram or ngram),
            min_count=int(min_count),
        )
        print(
            f"datastore {d}: {len(datastores[d])} n-grams from {datastores[d].sequences} responses "
            f"({datastores[d].excluded} replayed ones left out)",
            flush=True,
        )

    taus, rows_verified, lookup_share = {}, {}, {}
    for (vocab, vocab_proposer), setting in ((p, s) for p in proposers.items() for s in settings + lookup_settings):
        kind, cutoff, size, branching, ngram, datastore = setting
        lengths, verified, sources = [], [], []
        policy = replayed_policy(setting, vocab_proposer, datastores, args.lookup_tokens)
        for s in seq_ids:
            lengths += replay_acceptance(
                policy, store, s, max_new_tokens=args.max_new_tokens, verified=verified, sources=sources
            )
        lookups = [source in ("lookup", "datastore") for source in sources]
        taus[vocab, setting] = sum(lengths) / len(lengths)
        looked = [v for v, k in zip(verified, lookups) if k]
        lookup_share[vocab, setting] = len(looked) / len(lookups) if kind == "lookup" else 0.0
        if vocab != args.draft_vocabs[0]:  # the verify shapes timed are the first vocabulary's
            print(
                f"replayed {setting} with draft vocabulary {vocab or 'all'}: tau {taus[vocab, setting]:.3f}", flush=True
            )
            continue
        if kind == "lookup":
            rows_verified[setting] = 1 + round(sum(looked) / max(len(looked), 1))  # its lookup rounds' verify rows
        else:
            rows_verified[setting] = 1 + round(sum(verified) / len(verified))  # a verify forward's rows, typically
        print(
            f"replayed {setting}: tau {taus[vocab, setting]:.3f}, "
            f"{sum(verified) / len(verified):.2f} drafts verified a round",
            flush=True,
        )

    if args.replay_only:
        return
    # Verify cost: real draft logits at a real context, a cache of ~300 tokens.
    seq = max(
        (store.read(store.index(s), layers=proposer.layer_ids) for s in seq_ids[:10]), key=lambda q: len(q.input_ids)
    )
    ids = torch.as_tensor(seq.input_ids)[None]
    start = min(300, ids.shape[1] - drafter.block_size)
    features = seq.features.to(dtype)[None]
    block = torch.full((1, drafter.block_size), drafter.mask_token_id)
    block[0, 0] = ids[0, start]
    with torch.inference_mode():

        def draft(
            timed=False, proposer=proposer
        ):  # as a served round drafts: the cache holds the context but its newest 2 tokens
            proposer.start()
            proposer(block, features[:, : start - 2], start - 2)
            t0 = time.perf_counter()
            logits = proposer(block, features[:, start - 2 : start], start)
            return (time.perf_counter() - t0) if timed else logits

        logits = draft()
        shapes = sorted(rows_verified.items(), key=lambda kv: kv[1])

        def verify(setting, rows):
            cache = DynamicCache(config=target.config)
            target(ids[:, :start], cache=cache, use_cache=True, logits_to_keep=1)
            kind, _, size, branching, _, _ = setting
            if kind == "tree":
                tree = build_tree(logits, size, branching)
                tokens = torch.cat([block[:, :1], tree.tokens[None]], dim=1)
                kw = dict(position_ids=start + torch.tensor([[0, *tree.depths]]), attention_mask=tree_mask(tree, start))
            else:
                tokens, kw = ids[:, start : start + rows], dict(position_ids=torch.arange(start, start + rows)[None])
            t0 = time.perf_counter()
            target(tokens, cache=cache, use_cache=True, output_hidden_states=True, **kw)
            return time.perf_counter() - t0

        times = {"plain": [], **{("draft", k): [] for k in proposers}, **{s: [] for s, _ in shapes}}
        for _ in range(args.repeats + 1):  # the first pass warms up and is dropped
            times["plain"].append(verify(("chain", 0, 0, 0, 0, ""), 1))
            for k, p in proposers.items():
                times["draft", k].append(draft(timed=True, proposer=p))
            for setting, rows in shapes:
                times[setting].append(verify(setting, rows))
    ms = {k: 1000 * statistics.median(v[1:]) for k, v in times.items()}
    print(
        f"\nSmolLM2-135M {str(dtype).removeprefix('torch.')} ({target.config._attn_implementation}), "
        f"drafter {args.drafter} "
        f"(block {drafter.block_size}), replay on {len(seq_ids)} responses of {args.store} "
        f"(<= {args.max_new_tokens} tokens), "
        f"cache {start} tokens, {torch.get_num_threads()} threads, medians of {args.repeats}"
    )
    drafts = ", ".join(f"{ms['draft', k]:.1f} ms ({f'{k} words' if k else 'all words'})" for k in proposers)
    print(f"plain step {ms['plain']:.1f} ms, draft {drafts}")
    print("setting                          vocab   replay tau  rows  verify ms  round/plain step  predicted speedup")
    for vocab in proposers:  # lookup rounds are timed as a chain of their rows; their other rounds are the tree's
        for setting in settings + lookup_settings:
            kind, cutoff, size, branching, ngram, datastore = setting
            name = {"chain": f"chain cutoff {cutoff:g}", "tree": f"tree {size}x{branching}"}.get(
                kind, f"lookup {ngram}{' + datastore ' + datastore if datastore else ''} + tree {size}x{branching}"
            )
            share = lookup_share[vocab, setting]
            tree = setting if kind != "lookup" else ("tree", 0.0, size, branching, 0, "")
            round_ms = share * ms[setting] + (1 - share) * (ms["draft", vocab] + ms[tree])
            note = f"  ({100 * share:.0f}% lookup rounds; rows and verify ms: theirs)" if kind == "lookup" else ""
            print(
                f"{name:32s} {vocab or 'all':>5}  {taus[vocab, setting]:10.3f}  "
                f"{rows_verified[setting]:4d}  {ms[setting]:9.1f}  "
                f"{round_ms / ms['plain']:16.2f}  {taus[vocab, setting] * ms['plain'] / round_ms:16.2f}x{note}"
            )


if __name__ == "__main__":
    main()
