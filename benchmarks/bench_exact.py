"""What exact verification costs a plain decode step and an 8-row verify forward.

Two copies of the embedded target in `--dtype` (auto: what the harness picks): as loaded (unpadded GEMMs, SDPA)
and made exact (`make_verification_exact`: each GEMM shape padded as far as its probe asks, row-wise attention).
Plain greedy decoding of a few HumanEval prompts runs on each in turn, per prompt (so load drifts hit both); then
8-row verify forwards over a cache of the prompt and its output. Prints the probed GEMM rows, median step and
verify times and their ratios, and checks that the exact copy's verify logits equal its one-token steps."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashdraft.prompts import load_prompts
from flashdraft.target import (
    chat_input_ids,
    exact_gemm_rows,
    load_target,
    make_verification_exact,
    resolve_dtype,
    stop_token_ids,
)
from harness.speculative import speculative_generate


def verify_equals_steps(model, context: torch.Tensor, rows: int) -> bool:
    """The exact copy's promise: a `rows`-token forward gives the logits of `rows` one-token forwards."""
    cache = model(context[:, :-rows], use_cache=True).past_key_values
    block = model(context[:, -rows:], past_key_values=cache, use_cache=True).logits[0]
    cache.crop(-rows)
    steps = [
        model(context[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1]
        for t in range(context.shape[1] - rows, context.shape[1])
    ]
    return torch.equal(block, torch.stack(steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--verify-rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10, help="verify forwards per prompt and copy")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")
    loaded, tokenizer = load_target("smollm2-135m", dtype=dtype)
    exact = make_verification_exact(load_target("smollm2-135m", dtype=dtype)[0])
    copies = {"as loaded": loaded, "exact": exact}
    stop = stop_token_ids(loaded, tokenizer)
    prompts = [
        chat_input_ids(tokenizer, list(r.messages))
        for r in load_prompts("humaneval", split="heldout", limit=args.prompts)
    ]
    for model in copies.values():
        speculative_generate(model, prompts[0], max_new_tokens=4)  # warm-up
    steps = {name: [] for name in copies}
    verify = {name: [] for name in copies}
    exact_ok = True
    with torch.inference_mode():
        for ids in prompts:
            tokens = {}
            for name, model in copies.items():
                out = speculative_generate(model, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
                steps[name] += out.verify_s
                tokens[name] = out.tokens
            context = torch.tensor([list(ids) + tokens["exact"]])
            block = context[:, -args.verify_rows :]
            for name, model in copies.items():
                cache = model(context[:, : -args.verify_rows], use_cache=True).past_key_values
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    model(block, past_key_values=cache, use_cache=True)
                    verify[name].append(time.perf_counter() - t0)
                    cache.crop(-args.verify_rows)
            exact_ok &= verify_equals_steps(exact, context, args.verify_rows)
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    print(
        f"SmolLM2-135M {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
        f"{len(prompts)} HumanEval prompts x "
        f"{args.max_new_tokens} tokens; probed GEMM rows: {exact_gemm_rows(exact)}"
    )
    base = ms(steps["as loaded"])
    for name in copies:
        print(
            f"{name:10s} plain step {ms(steps[name]):7.2f} ms ({ms(steps[name]) / base:.2f}x as loaded)   "
            f"{args.verify_rows}-row verify {ms(verify[name]):7.2f} ms "
            f"({ms(verify[name]) / ms(steps[name]):.2f} plain steps)"
        )
    print(f"exact verify logits equal its one-token steps: {exact_ok}")


if __name__ == "__main__":
    main()
