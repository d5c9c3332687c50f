"""Wall-clock of one speculative round (draft / verify / bookkeeping) against one plain decode step.

    .venv/bin/python benchmarks/bench_round.py [--prompts 3] [--max-new-tokens 48] [--block-size 16] [--threads N]
                                               [--dtype auto|float32|bfloat16] [--tree-size 15] [--drafter PATH]

SmolLM2-135M (the embedded default) with an untrained 5-layer drafter (or --drafter) on held-out HumanEval
prompts, a chain verified a round (or with --tree-size, a tree of that many candidates); both loops are the harness's, \
so the ratios compare like with like. Printed ratios:
round / plain step (the cost tau must beat), verify / plain step, draft / plain step, and the
break-even tau (speedup = tau * plain step / round); on CPU, where the harness makes verification exact, also
the plain step of the target left as loaded (what exactness costs plain decoding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashdraft.target as ft
from flashdraft.prompts import load_prompts
from harness.drafter import DrafterProposer, load_drafter
from harness.policies import ChainPolicy, TreePolicy
from harness.speculative import speculative_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--dtype", default="float32", help="auto = what the harness picks (bf16 on CPUs with AMX or AVX512-BF16)"
    )
    ap.add_argument("--tree-size", type=int, default=0, help="verify a tree of this many candidates (0: one chain)")
    ap.add_argument("--drafter", default=None, help="a trained drafter folder (default: an untrained one)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = ft.resolve_dtype(args.dtype, "cpu")
    target, tokenizer = ft.load_target("smollm2-135m", dtype=dtype)
    drafter, untrained = load_drafter(args.drafter, target, tokenizer, allow_untrained=True, block_size=args.block_size)
    unpatched = None
    if ft.needs_exact_verification(dtype, "cpu"):  # as the harness does
        unpatched = ft.load_target("smollm2-135m", dtype=dtype)[
            0
        ]  # plain decoding as a user runs it, for the last line
        ft.make_verification_exact(target)
    proposer = DrafterProposer(drafter, ft.frozen_head_from_model(target))
    policy = TreePolicy(proposer, args.tree_size) if args.tree_size else ChainPolicy(proposer)
    stop = ft.stop_token_ids(target, tokenizer)
    prompts = [
        ft.chat_input_ids(tokenizer, list(r.messages))
        for r in load_prompts("humaneval", split="heldout", limit=args.prompts)
    ]
    speculative_generate(target, prompts[0], policy, max_new_tokens=4)  # warm-up

    draft, verify, book, plain_steps, unpatched_steps, prompt_lens, cache_lens, taus = [], [], [], [], [], [], [], []
    for ids in prompts:  # plain and DFlash alternate per prompt so load drifts hit both
        plain = speculative_generate(target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
        plain_steps += plain.verify_s  # block 1: each round is one target forward over one token
        if unpatched is not None:
            unpatched_steps += speculative_generate(
                unpatched, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stop
            ).verify_s
        spec = speculative_generate(target, ids, policy, max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
        taus.append(spec.tau)
        draft += spec.draft_s
        verify += spec.verify_s
        book += spec.bookkeeping_s
        prompt_lens.append(len(ids))
        cache_lens.append(len(ids) + len(spec.tokens))
    block_size = drafter.block_size
    head_in = torch.randn(block_size - 1, target.config.hidden_size, dtype=dtype)
    t0 = time.perf_counter()
    for _ in range(20):
        proposer.head.lm_head(head_in)
    head_ms = (time.perf_counter() - t0) / 20 * 1000

    ms = lambda xs: 1000 * statistics.mean(xs)  # noqa: E731
    step, rnd = ms(plain_steps), ms(draft) + ms(verify) + ms(book)
    verified = f"a tree of {args.tree_size} candidates" if args.tree_size else "one chain"
    print(
        f"SmolLM2-135M {str(dtype).removeprefix('torch.')} ({target.config._attn_implementation} attention), "
        f"{'untrained' if untrained else 'trained'} {len(drafter.layers)}-layer drafter "
        f"({drafter.num_parameters() / 1e6:.1f}M params), "
        f"block {block_size}, {verified} verified a round, {len(prompts)} HumanEval prompts "
        f"({min(prompt_lens)}-{max(prompt_lens)} tokens, "
        f"up to {max(cache_lens)} with output), {torch.get_num_threads()} threads"
    )
    print(f"plain decode step    {step:8.2f} ms  ({len(plain_steps)} steps)")
    print(
        f"round: draft        {ms(draft):8.2f} ms  "
        f"(of which the output head over {block_size - 1} positions ~{head_ms:.2f} ms)"
    )
    print(
        f"       verify       {ms(verify):8.2f} ms  "
        f"(target forward over {args.tree_size + 1 if args.tree_size else block_size} tokens)"
    )
    print(f"       bookkeeping  {ms(book):8.2f} ms")
    print(f"       total        {rnd:8.2f} ms  ({len(draft)} rounds)")
    print(
        f"ratios: round/plain step {rnd / step:.2f}, verify/plain step {ms(verify) / step:.2f}, "
        f"draft/plain step {ms(draft) / step:.2f}, bookkeeping/round {ms(book) / rnd:.3f}"
    )
    print(
        f"break-even tau {rnd / step:.2f}: speedup = tau x {step / rnd:.2f}"
        + ("" if untrained else f"; measured tau {sum(taus) / len(taus):.2f}")
    )
    if unpatched_steps:
        print(
            "plain decode step of the target without exact verification "
            f"(unpadded GEMMs, {unpatched.config._attn_implementation}): "
            f"{ms(unpatched_steps):.2f} ms, {ms(unpatched_steps) / step:.2f}x "
            "the exact step the speedups are measured against"
        )


if __name__ == "__main__":
    main()
