"""Trainer benchmark, one run, same machine, same inputs (SmolLM2-135M width, the CPU profile):

* step time: a full trainer step (mask, DeepSpeed engine, chunked CE, optimizer) against the bare
  drafter forward + backward of the same batch with a plain weighted cross entropy and a torch
  AdamW step (goal <= 1.3x);
* loader throughput: sequences/s the loader delivers against what a step consumes (goal >= 20x);
* time to first batch on a large store (2000 sequences of random features; goal <= 5 s);
* tokens/s.

    .venv/bin/python benchmarks/bench_trainer.py [--sequences 2000] [--store /tmp/flashdraft-bench-store]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec, default_layer_ids
from flashdraft.store import StoreReader, is_store, write_store
from flashdraft.target import load_frozen_head, resolve_target
from trainer.data import Prefetcher, TrainingData
from trainer.engine import build_engine, setup_distributed_env
from trainer.loss import default_gamma
from trainer.objective import attention_mask, forward_loss

HIDDEN, LAYERS = 576, default_layer_ids(30, 5)


def build_store(path: Path, n: int, seed: int = 0) -> StoreReader:
    if is_store(path) and len(StoreReader(path)) == n:
        return StoreReader(path)
    shutil.rmtree(path, ignore_errors=True)
    rng = np.random.default_rng(seed)

    def sequences():
        for i in tqdm(range(n), desc="bench store", unit="seq"):
            s = int(rng.integers(96, 320))
            mask = np.zeros(s, bool)
            mask[int(rng.integers(16, 64)) :] = True
            yield {
                "seq_id": f"bench-{i}",
                "input_ids": rng.integers(0, 49152, s),
                "loss_mask": mask,
                "features": torch.randn(s, len(LAYERS) * HIDDEN),
            }

    return write_store(
        path, sequences(), layer_ids=LAYERS, hidden_size=HIDDEN, dtype="bfloat16", manifest_extra={"vocab_size": 49152}
    )


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=2000)
    ap.add_argument("--store", default="/tmp/flashdraft-bench-store")
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--token-budget", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, default=4, help="loader threads (train.loader_workers)")
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    setup_distributed_env()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    store = build_store(Path(args.store), args.sequences)
    B, gamma = 16, default_gamma(16)

    # --- time to first batch: open the store, count anchors, plan the epoch, build batch 1
    t0 = time.perf_counter()
    data = TrainingData(
        [args.store],
        layer_ids=LAYERS,
        block_size=B,
        num_anchors=args.anchors,
        max_length=768,
        mask_token_id=0,
        gamma=gamma,
        heldout_fraction=0.02,
    )
    plan = data.plan(0, token_budget=args.token_budget)
    mbs = [mb for s in plan.steps for mb in s]
    loader = Prefetcher(data, mbs, 0, workers=args.workers, depth=2 * args.workers)
    first = next(loader)
    first_batch_s = time.perf_counter() - t0
    loader.close()

    # --- loader throughput (no trainer consuming: the rate it can sustain)
    n_mb = min(40, len(mbs))
    t0 = time.perf_counter()
    loader = Prefetcher(data, mbs[:n_mb], 0, workers=args.workers, depth=2 * args.workers)
    n_seq = sum(len(b.seq_ids) for b in loader)
    loader_seq_s = n_seq / (time.perf_counter() - t0)

    # --- step time: trainer step vs the bare drafter forward + backward
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(resolve_target("smollm2-135m"))
    head = load_frozen_head("smollm2-135m")
    dcfg = DraftSpec(LAYERS, mask_token_id=0, block_size=B, num_draft_layers=5).draft_config(tcfg)
    batch = first.to("cpu", torch.float32)  # the loader keeps the stored precision; the step takes float32
    torch.manual_seed(0)
    bare = DFlashDrafter(dcfg)
    opt = torch.optim.AdamW(bare.parameters(), lr=6e-4)

    def bare_step():
        mask = attention_mask(batch, B, "dense")
        hidden = bare(head.embed_tokens(batch.block_ids), batch.context, batch.position_ids, attention_mask=mask)
        rows = batch.weights.reshape(-1) > 0
        logits = head.lm_head(hidden.reshape(-1, HIDDEN)[rows])
        w = batch.weights.reshape(-1)[rows]
        loss = (F.cross_entropy(logits, batch.labels.reshape(-1)[rows], reduction="none") * w).sum() / w.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    torch.manual_seed(0)
    engine, _ = build_engine(
        DFlashDrafter(dcfg),
        lr=6e-4,
        weight_decay=0.0,
        betas=(0.9, 0.95),
        warmup_steps=1,
        total_steps=100,
        zero_stage=2,
        grad_accum=1,
        grad_clip=1.0,
        bf16=False,
    )

    def trainer_step():
        loss, _ = forward_loss(engine, head, batch, block_size=B, attention="dense", ce_chunk=512)
        engine.backward(loss)
        engine.step()

    bare_step(), trainer_step()  # warm up
    # interleaved, medians: on a shared CPU the load changes from one second to the next
    pairs = [(timed(bare_step, 1), timed(trainer_step, 1)) for _ in range(args.repeats)]
    bare_s = statistics.median(p[0] for p in pairs)
    step_s = statistics.median(p[1] for p in pairs)
    seqs_per_step = len(batch.seq_ids)
    need_seq_s = seqs_per_step / step_s

    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; step pairs (bare, trainer) ms: "
        f"{[(round(a * 1e3), round(b * 1e3)) for a, b in pairs]}"
    )
    print(
        f"store: {len(store)} sequences, {int(store.lengths.sum())} tokens, "
        f"SmolLM2 width ({len(LAYERS)}x{HIDDEN}), bf16"
    )
    print(
        f"batch: {seqs_per_step} sequences, {batch.tokens} context tokens, {batch.anchors.shape[1]} anchors x {B}, "
        f"{int((batch.weights > 0).sum())} loss rows"
    )
    print(
        f"step time: trainer {step_s * 1e3:.0f} ms vs bare drafter fwd+bwd+AdamW {bare_s * 1e3:.0f} ms -> "
        f"{step_s / bare_s:.2f}x (goal <= 1.3x)"
    )
    print(
        f"loader: {loader_seq_s:.1f} sequences/s vs {need_seq_s:.2f} needed -> "
        f"{loader_seq_s / need_seq_s:.1f}x (goal >= 20x)"
    )
    print(f"time to first batch: {first_batch_s:.2f} s on {len(store)} sequences (goal <= 5 s)")
    print(
        f"tokens/s: {batch.tokens / step_s:.0f} context tokens/s, "
        f"{batch.anchors.numel() * B / step_s:.0f} block tokens/s"
    )


if __name__ == "__main__":
    main()
