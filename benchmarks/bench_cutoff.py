"""DFlash with the whole block verified vs only its confident prefix (`eval.draft_cutoff`), one run.

    .venv/bin/python benchmarks/bench_cutoff.py --drafter runs/full-smollm2-135m/drafter
        [--cutoffs 0 0.05 0.1 0.2 0.3] [--limit 6] [--max-new-tokens 128] [--dtype auto]

The embedded default target on held-out HumanEval and MT-Bench prompts, greedy, the harness's own loop
and exact verification. Per prompt, plain decoding and DFlash at every cutoff run back to back, so load
drifts hit all alike. Printed per cutoff: tau, drafts verified per round, round time split, decode
tokens/s and the speedup over plain decoding; every output is checked against plain decoding's.
"""

from __future__ import annotations

import argparse

import torch

import flashdraft.target as ft
from flashdraft.model import DFlashDrafter
from harness.drafter import DrafterProposer
from harness.evaluate import build_prompts
from harness.policies import ChainPolicy
from harness.speculative import speculative_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="a trained drafter folder (config.json + model.safetensors)")
    ap.add_argument("--cutoffs", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3])
    ap.add_argument("--limit", type=int, default=6, help="held-out prompts per source")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = ft.resolve_dtype(args.dtype, "cpu")
    target, tokenizer = ft.load_target("smollm2-135m", dtype=dtype)
    drafter = DFlashDrafter.from_pretrained(args.drafter, dtype=dtype)
    if ft.needs_exact_verification(dtype, "cpu"):
        ft.make_verification_exact(target)
    proposer = DrafterProposer(drafter, ft.frozen_head_from_model(target))
    stop = ft.stop_token_ids(target, tokenizer)
    prompts = build_prompts(tokenizer, ["humaneval", "mtbench"], split="heldout", limit=args.limit)
    common = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
    speculative_generate(target, prompts[0].input_ids, ChainPolicy(proposer), max_new_tokens=8)  # warm-up

    arms = {c: ChainPolicy(proposer, cutoff=c) for c in args.cutoffs}
    plain_s, plain_tokens = 0.0, 0
    runs = {c: [] for c in arms}
    for i, p in enumerate(prompts):
        plain = speculative_generate(target, p.input_ids, **common)
        plain_s += plain.decode_s
        plain_tokens += plain.decode_tokens
        for c, arm in arms.items():
            g = speculative_generate(target, p.input_ids, arm, **common)
            if g.tokens != plain.tokens:
                raise AssertionError(f"cutoff {c}: output differs from plain decoding on {p.source}/{p.record_id}")
            runs[c].append(g)
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    plain_rate = plain_tokens / plain_s
    print(
        f"\nSmolLM2-135M {str(dtype).removeprefix('torch.')}, drafter {args.drafter} (block {drafter.block_size}), "
        f"{len(prompts)} held-out prompts x {args.max_new_tokens} tokens, {torch.get_num_threads()} threads; "
        f"plain {plain_rate:.2f} tokens/s, every output identical to plain"
    )
    print("    cutoff   tau  verified/round  draft ms  verify ms  round ms  tokens/s  speedup")
    for c, gens in runs.items():
        rounds = sum(len(g.acceptance_lengths) for g in gens)
        tokens = sum(g.decode_tokens for g in gens)
        seconds = sum(g.decode_s for g in gens)
        ms = lambda part, gens=gens, rounds=rounds: 1000 * sum(sum(getattr(g, part)) for g in gens) / rounds  # noqa: E731
        verified = sum(sum(g.verified_drafts) for g in gens) / rounds
        print(
            f"{c:10.2f} {tokens / rounds:5.2f}  {verified:14.2f}  {ms('draft_s'):8.1f}  {ms('verify_s'):9.1f}  "
            f"{1000 * seconds / rounds:8.1f}  {tokens / seconds:8.2f}  {tokens / seconds / plain_rate:6.2f}x"
        )


if __name__ == "__main__":
    main()
