"""Capture throughput: continuous batching (`regenerate`) vs transformers `generate` in static batches.

    .venv/bin/python benchmarks/bench_batching.py [--prompts 64] [--new-tokens 256] [--batch-sizes 32 48 64]
                                                  [--dtype bfloat16] [--sources pystubs chatseeds]

Same machine, same prompts (train split, sorted by length as the capture worker sorts them), greedy.
The baseline is plain `generate` over static batches of 32, the way the capture ran before: a batch
decodes until its longest response ends and captures nothing. `regenerate` captures the 5 layers'
features too, and its rows leave the batch as they end while waiting prompts take their place.
Printed: new tokens/s of each and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import time

import torch

from flashdraft.prompts import load_prompts
from flashdraft.spec import capture_layer_ids
from flashdraft.target import chat_input_ids, load_target, resolve_dtype, stop_token_ids
from pipeline.capture import left_pad
from pipeline.decode import regenerate


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="per source")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 48, 64])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sources", nargs="+", default=["pystubs", "chatseeds"])
    args = ap.parse_args()

    model, tok = load_target("smollm2-135m", dtype=resolve_dtype(args.dtype, "cpu"))
    layers = capture_layer_ids(model.config)
    stops = stop_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    records = [r for s in args.sources for r in load_prompts(s, split="train", limit=args.prompts)]
    prompts = sorted((chat_input_ids(tok, list(r.messages)) for r in records), key=len)

    def static(batch_size=32):
        new = 0
        for b in range(0, len(prompts), batch_size):
            ids, mask, _ = left_pad(prompts[b : b + batch_size], pad, "cpu")
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.new_tokens,
                do_sample=False,
                eos_token_id=stops,
                pad_token_id=pad,
            )
            for row in out[:, ids.shape[1] :].tolist():
                new += next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        return new

    def continuous(batch_size):
        caps = regenerate(
            model, prompts, layers, max_new_tokens=args.new_tokens, stop_ids=stops, pad_id=pad, batch_size=batch_size
        )
        return sum(int(c.loss_mask.sum()) for c in caps)

    print(
        f"SmolLM2-135M {args.dtype}, {len(prompts)} train prompts ({', '.join(args.sources)}; "
        f"{len(prompts[0])}-{len(prompts[-1])} tokens), <= {args.new_tokens} new tokens, greedy, "
        f"{torch.get_num_threads()} threads"
    )
    with torch.inference_mode():
        regenerate(model, prompts[:4], layers, max_new_tokens=4, stop_ids=stops, pad_id=pad)  # warm-up
        t = time.perf_counter()
        base = static() / (time.perf_counter() - t)
        print(f"generate, static batches of 32 (no capture)   {base:7.1f} new tokens/s")
        for bs in args.batch_sizes:
            t = time.perf_counter()
            rate = continuous(bs) / (time.perf_counter() - t)
            print(f"regenerate + capture, continuous batch {bs:3d}    {rate:7.1f} new tokens/s   {rate / base:5.2f}x")


if __name__ == "__main__":
    main()
