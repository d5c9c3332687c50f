"""What exact verification costs a plain decode step and an 8-row verify forward, probed padding vs fixed tiles.

Three copies of the embedded target in `--dtype` (auto: what the harness picks): as loaded (unpadded GEMMs,
SDPA), exact with every GEMM tile padded to 16 rows (`make_verification_exact(min_rows=16)`, the harness before
2026-12-04) and exact with each shape padded only as far as its probe asks (`exact_base_rows`, the harness now).
Plain greedy decoding of a few HumanEval prompts runs on each in turn, per prompt (so load drifts hit all three);
then 8-row verify forwards over a cache of the prompt and its output. Prints median step and verify times, their
ratios, and checks the two exact copies give the same tokens and bit-identical verify logits."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashdraft.prompts import load_prompts
from flashdraft.target import chat_input_ids, exact_gemm_rows, load_target, make_verification_exact, resolve_dtype, stop_token_ids
from harness.speculative import speculative_generate


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
    fixed = make_verification_exact(load_target("smollm2-135m", dtype=dtype)[0], min_rows=16)
    probed = make_verification_exact(load_target("smollm2-135m", dtype=dtype)[0])
    copies = {"as loaded": loaded, "exact, 16-row tiles": fixed, "exact, probed": probed}
    stop = stop_token_ids(loaded, tokenizer)
    prompts = [chat_input_ids(tokenizer, list(r.messages)) for r in load_prompts("humaneval", split="heldout", limit=args.prompts)]
    for model in copies.values():
        speculative_generate(model, prompts[0], max_new_tokens=4)  # warm-up
    steps = {name: [] for name in copies}
    verify = {name: [] for name in copies}
    same_tokens, same_logits = True, True
    for ids in prompts:
        tokens = {}
        for name, model in copies.items():
            out = speculative_generate(model, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stop)
            steps[name] += out.verify_s
            tokens[name] = out.tokens
        same_tokens &= tokens["exact, 16-row tiles"] == tokens["exact, probed"]
        context = torch.tensor([list(ids) + tokens["exact, probed"]])
        block = context[:, -args.verify_rows :]
        logits = {}
        for name, model in copies.items():
            cache = model(context[:, : -args.verify_rows], use_cache=True).past_key_values
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                logits[name] = model(block, past_key_values=cache, use_cache=True).logits
                verify[name].append(time.perf_counter() - t0)
                cache.crop(-args.verify_rows)
        same_logits &= torch.equal(logits["exact, 16-row tiles"], logits["exact, probed"])
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    print(f"SmolLM2-135M {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, {len(prompts)} HumanEval prompts x "
          f"{args.max_new_tokens} tokens; probed GEMM rows: {exact_gemm_rows(probed)}")
    base = ms(steps["as loaded"])
    for name in copies:
        print(f"{name:22s} plain step {ms(steps[name]):7.2f} ms ({ms(steps[name]) / base:.2f}x as loaded)   "
              f"{args.verify_rows}-row verify {ms(verify[name]):7.2f} ms ({ms(verify[name]) / ms(steps[name]):.2f} plain steps)")
    print(f"probed vs 16-row tiles: plain step {ms(steps['exact, 16-row tiles']) / ms(steps['exact, probed']):.2f}x faster, "
          f"verify {ms(verify['exact, 16-row tiles']) / ms(verify['exact, probed']):.2f}x faster; "
          f"same tokens: {same_tokens}, bit-identical verify logits: {same_logits}")


if __name__ == "__main__":
    main()
