"""Capture throughput from one run, before and after: the decode loop alone, the shard writer alone (per codec and
per thread count), and the whole capture; then the writer's MB/s a core and the cores a GPU needs in capture mode.

    git worktree add /tmp/flashdraft-before 50e5117     # the code to compare against
    .venv/bin/python benchmarks/bench_capture.py --before /tmp/flashdraft-before [--prompts 48] [--new-tokens 32]

Every measurement runs in a fresh process with one checkout first on the path (`--before`, then this one), on the
same inputs: a random Qwen3 (hidden 1024, 6 layers, 5 captured, fp32, SmolLM2 tokenizer; benchmarks/
bench_capture_memory.py builds it), the same prompts, greedy, the CPU's auto batch (8 rows), `--threads` torch
threads. "decode" is `regenerate_stream` over all prompts with nothing written; "writer" appends the sequences that
decode produced to one shard and commits it (before: `ShardWriter` in the calling thread, as the decode loop called
it; after: `BackgroundShard`, the writing thread plus a compression pool of N threads where N > 1); "capture" is the
in-process fleet (`run_fleet`, num_actors 0) over tasks of `--shard-size` prompts, writing a bf16 blosc-zstd store
(after: with the checkout's default writer, and again with one writing thread, the writer off the decode loop as on a
GPU); the last before and after stores are compared (tokens, loss masks, feature values).
Each figure is the best of `--repeats` runs, before and after alternated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
CODECS = ("blosc-zstd", "blosc-lz4", "zstd", "none")
QWEN3_8B_TOKEN_BYTES = 5 * 4096 * 2  # 5 captured layers x hidden 4096 x bf16
CAPTURE_MODE_TOKENS_S = 20_000  # the estimate for one H100 prefilling Qwen3-8B (not measured here)


def prompts(n: int) -> list:
    from flashdraft.prompts import PromptRecord

    words = "explain why the sky looks blue at noon and red at sunset in plain words please".split()
    asks = [" ".join(words[i % 7 : i % 7 + 3 + i % 5]) for i in range(n)]
    user = lambda text: ({"role": "user", "content": text},)  # noqa: E731
    return [PromptRecord(f"b{i}", "bench", str(i), user(a), "train") for i, a in enumerate(asks)]


def settings(args):
    from flashdraft.config import SamplingConfig

    try:
        from pipeline.settings import CaptureSettings
    except ImportError:  # a checkout before pipeline/settings.py (--before)
        from pipeline.worker import CaptureSettings

    return CaptureSettings(  # every field named: the checkouts compared differ in which have defaults
        target=args.target,
        layer_ids=(1, 2, 3, 4, 5),
        dtype="float32",
        device="cpu",
        mode="regenerate",
        turns="single",
        max_new_tokens=args.new_tokens,
        max_length=3072,
        max_prompt_tokens=2048,
        batch_size="auto",
        prefill_tokens="auto",
        gpu_memory_fraction=0.85,
        sampling=SamplingConfig(),
        seed=0,
        system_prompt=None,
        enable_thinking=None,
        thinking_share=None,
        trust_remote_code=False,
        torch_threads=args.threads,
    )


def child_decode(args) -> dict:
    """The decode loop alone; saves what it produced (for the writer) and returns its rate."""
    import torch

    from pipeline.job import open_store
    from pipeline.worker import CaptureWorker

    try:
        from pipeline.decode import regenerate_stream
    except ImportError:  # a checkout before regenerate_stream moved to pipeline/decode.py (--before)
        from pipeline.capture import regenerate_stream

    s = settings(args)
    store = Path(args.work) / "decode-store"
    open_store(store, s, sources=["bench"], store_options={})
    worker = CaptureWorker(str(store), s)
    # a checkout before pipeline/encode.py and pipeline/plan.py (--before): the worker itself encodes and plans
    encoder, rows = getattr(worker, "encoder", worker), getattr(worker, "plan", worker).batch_size
    ids = [encoder.encode(r)[0] for r in prompts(args.prompts)]
    t = time.perf_counter()
    out = list(
        regenerate_stream(
            worker.model,
            ids,
            list(s.layer_ids),
            max_new_tokens=args.new_tokens,
            stop_ids=encoder.stop_ids,
            pad_id=encoder.pad_id,
            batch_size=rows,
        )
    )
    seconds = time.perf_counter() - t
    tokens = sum(len(c.input_ids) - len(ids[i]) for i, c in out)  # decoded tokens
    if args.save:
        torch.save([(c.input_ids, c.loss_mask, c.features) for _, c in out], args.save)
    return {"tokens": tokens, "seconds": seconds, "rows": rows}


def child_writer(args) -> dict:
    """One shard of the saved sequences per codec (and thread count, after); rate of the features' bf16 bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from flashdraft.store import ShardWriter, StoreLayout

    seqs = torch.load(args.save, weights_only=True)
    tokens = sum(len(ids) for ids, _, _ in seqs)
    width = seqs[0][2].shape[1]
    background = args.writer_threads is not None

    def write(codec: str) -> float:
        layout = StoreLayout(layer_ids=(1, 2, 3, 4, 5), hidden_size=width // 5, codec=codec)
        folder = Path(tempfile.mkdtemp(dir=args.work))
        (folder / "shards").mkdir()
        t = time.perf_counter()
        if background:
            from pipeline.shardqueue import BackgroundShard

            n = args.writer_threads
            pool = ThreadPoolExecutor(n) if n > 1 else None
            shard = BackgroundShard(folder, "shard-00000", layout, pool=pool)
        else:
            shard = ShardWriter(folder, "shard-00000", layout)
        for j, (ids, mask, feats) in enumerate(seqs):
            shard.append(f"s{j}", ids, mask, feats)
        shard.commit()
        return time.perf_counter() - t

    write("blosc-zstd")  # untimed: imports and first-call costs
    return {c: {"tokens": tokens, "seconds": write(c), "feature_bytes": tokens * width * 2} for c in CODECS}


def child_capture(args) -> dict:
    """The whole capture: the in-process fleet over tasks of `shard_size` prompts."""
    from pipeline.fleet import FleetConfig, run_fleet
    from pipeline.job import open_store

    s = settings(args)
    if args.writer_threads is not None:  # after only: the older checkout's settings have no such field
        s = dataclasses.replace(s, writer_threads=args.writer_threads)
    store = Path(tempfile.mkdtemp(dir=args.work)) / "store"
    writer = open_store(store, s, sources=["bench"], store_options={})
    fleet = FleetConfig(num_actors=0, shard_size=args.shard_size)
    t = time.perf_counter()
    summary = run_fleet(store, prompts(args.prompts), s, writer, fleet, progress=False)
    seconds = time.perf_counter() - t
    return {"tokens": summary.new_tokens, "seconds": seconds, "ok": summary.ok, "store": str(store)}


def child(args) -> None:
    import pipeline.capture

    result = {"decode": child_decode, "writer": child_writer, "capture": child_capture}[args.child](args)
    result = {"result": result, "code": str(Path(pipeline.capture.__file__).resolve().parents[1])}
    print(json.dumps(result))


def run_child(code: Path, mode: str, args, target: str, work: Path, extra=()) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [sys.executable, __file__, "--child", mode, "--target", target, "--work", str(work)]
    cmd += ["--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    cmd += ["--shard-size", str(args.shard_size), "--save", str(work / "decoded.pt"), *extra]
    out = subprocess.run(cmd, env=env, cwd=code, check=True, capture_output=True, text=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    if Path(got["code"]) != code.resolve():
        raise RuntimeError(f"the child imported {got['code']}, not {code}")
    return got["result"]


def best(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["seconds"])


def measure(args, target: str, work: Path) -> dict:
    codes = [("before", Path(args.before)), ("after", REPO)]
    found: dict = {}
    for _ in range(args.repeats):
        for label, code in codes:
            found.setdefault(("decode", label), []).append(run_child(code, "decode", args, target, work))
            found.setdefault(("capture", label), []).append(run_child(code, "capture", args, target, work))
        one = ["--writer-threads", "1"]  # the writer off the decode loop, as on a GPU (a CPU's auto is 0: in the loop)
        found.setdefault(("capture", "after-1"), []).append(run_child(REPO, "capture", args, target, work, one))
    # the writer on the same sequences: those the current checkout decoded last
    for _ in range(args.repeats):
        found.setdefault(("writer", "before", 1), []).append(run_child(codes[0][1], "writer", args, target, work))
        for n in args.writer_threads:
            extra = ["--writer-threads", str(n)]
            found.setdefault(("writer", "after", n), []).append(run_child(REPO, "writer", args, target, work, extra))
    return found


def compare_stores(before: str, after: str) -> str:
    """Whether the two checkouts' stores hold the same tokens and loss masks, and how far their features differ."""
    from flashdraft.store import StoreReader

    b, a = StoreReader(before), StoreReader(after)
    if sorted(b.seq_ids) != sorted(a.seq_ids):
        return "stores: different sequences"
    same, diff, values = True, 0.0, 0
    for sid in b.seq_ids:
        x, y = b.read(b.index(sid)), a.read(a.index(sid))
        same &= np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)
        if x.features.shape == y.features.shape:
            diff = max(diff, float((x.features - y.features).abs().max()))
            values += int((x.features != y.features).sum())
    tokens = "tokens and loss masks identical" if same else "tokens or loss masks DIFFER"
    return f"stores before/after: {tokens}; features differ in {values} values, at most {diff:.3g}"


def rate(r: dict) -> float:
    return r["tokens"] / r["seconds"]


def print_tables(found: dict, args) -> None:
    print(f"{args.prompts} prompts, {args.new_tokens} new tokens, torch threads {args.threads}, best of {args.repeats}")
    print(f"{'':24} {'before tok/s':>13} {'after tok/s':>12} {'after/before':>13}")
    for part in ("decode", "capture"):
        b, a = rate(best(found[part, "before"])), rate(best(found[part, "after"]))
        name = "decode loop alone" if part == "decode" else "whole capture"
        print(f"{name:24} {b:13.0f} {a:12.0f} {a / b:12.2f}x")
    b, a = rate(best(found["capture", "before"])), rate(best(found["capture", "after-1"]))
    print(f"{'capture, 1 writer thread':24} {b:13.0f} {a:12.0f} {a / b:12.2f}x   (after: shards written off the loop)")
    print(args.stores)
    print(f"\nwriter alone (bf16 features {args.width} bytes a token): tokens/s, feature MB/s, MB/s a thread")
    print(f"{'codec':12} {'writer':22} {'tok/s':>9} {'MB/s':>8} {'MB/s/thread':>12}")
    per_core = {}
    for codec in CODECS:
        rows = [("before (decode thread)", 1, found["writer", "before", 1])]
        rows += [(f"after, {n} thread(s)", n, found["writer", "after", n]) for n in args.writer_threads]
        for label, n, runs in rows:
            r = min((x[codec] for x in runs), key=lambda x: x["seconds"])
            mbs = r["feature_bytes"] / r["seconds"] / 1e6
            print(f"{codec:12} {label:22} {rate(r):9.0f} {mbs:8.1f} {mbs / n:12.1f}")
            if label.startswith("before"):
                per_core[codec] = mbs
    gpu = f"{CAPTURE_MODE_TOKENS_S:,} tokens/s a GPU"
    print(f"\ncapture mode, Qwen3-8B ({QWEN3_8B_TOKEN_BYTES} bytes a token) at {gpu}")
    need = CAPTURE_MODE_TOKENS_S * QWEN3_8B_TOKEN_BYTES / 1e6
    for codec, mbs in per_core.items():
        print(f"  {codec:12} {need:.0f} MB/s / {mbs:.1f} MB/s a core = {need / mbs:.1f} cores a GPU (arithmetic)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="an older checkout (a git worktree of it)")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shard-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--writer-threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        given = "--writer-threads" in sys.argv
        args.writer_threads = args.writer_threads[0] if given else None
        return child(args)
    if not args.before:
        ap.error("--before PATH: a checkout to compare against (git worktree add PATH 50e5117)")
    from bench_capture_memory import build_target

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        target = build_target(work / "target")
        found = measure(args, target, work)
        args.stores = compare_stores(found["capture", "before"][-1]["store"], found["capture", "after"][-1]["store"])
    args.width = 5 * 1024 * 2
    print_tables(found, args)


if __name__ == "__main__":
    main()
