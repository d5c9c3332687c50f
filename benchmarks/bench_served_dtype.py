"""Served-order replay tau of one drafter served in float32, in bf16 (rotary frequencies kept float32, as
`DFlashDrafter` keeps them), and in bf16 with the rotary frequencies rounded to bf16 (what casting Qwen3's own rotary
embedding gives): the train/serve numerics the drafter's dtype alone changes, without running the target.

    python benchmarks/bench_served_dtype.py runs/quick-smollm2-135m/drafter runs/quick-smollm2-135m/features-heldout
    python benchmarks/bench_served_dtype.py DRAFTER STORE --sequences 16 --max-new-tokens 512

Replays the first `--sequences` sequences of STORE (all: 0) greedily with the chain policy (`harness.replay`), the
drafter scoring every word; prints tau, rounds and the longest position per way."""

from __future__ import annotations

import argparse
import time

import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from flashdraft.model import DFlashDrafter
from flashdraft.store import StoreReader
from flashdraft.target import load_frozen_head
from harness.drafter import DrafterProposer
from harness.policies import ChainPolicy
from harness.replay import replay_acceptance


def served(drafter_dir: str, way: str, target: str) -> DrafterProposer:
    dtype = torch.float32 if way == "float32" else torch.bfloat16
    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=dtype)
    if way == "bf16, rotary rounded":
        drafter.rotary_emb = Qwen3RotaryEmbedding(drafter.config).to(dtype=dtype)
    return DrafterProposer(drafter, load_frozen_head(target, dtype=dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter")
    parser.add_argument("store")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--sequences", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    args = parser.parse_args()
    store = StoreReader(args.store)
    seq_ids = list(store.seq_ids)[: args.sequences or None]
    longest = max(len(store.read(store.index(s), layers=[]).input_ids) for s in seq_ids)
    print(f"{args.drafter} on {len(seq_ids)} sequences of {args.store} (longest {longest} tokens)")
    for way in ("float32", "bf16", "bf16, rotary rounded"):
        policy = ChainPolicy(served(args.drafter, way, args.target))
        start = time.perf_counter()
        rounds = [n for s in seq_ids for n in replay_acceptance(policy, store, s, max_new_tokens=args.max_new_tokens)]
        print(
            f"{way:21} tau {sum(rounds) / len(rounds):.4f}  rounds {len(rounds)}  tokens {sum(rounds)}  "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
