"""A capture worker's peak host memory against its task size, from one run (optionally against another checkout).

    .venv/bin/python benchmarks/bench_capture_memory.py [--sizes 64 512] [--before /path/to/older/checkout]

Each measurement is a fresh process running what a Ray actor runs (`CaptureWorker.run` on one task, in-process)
on a tiny random Qwen3 target wide enough for its features to matter (hidden 1024, 6 layers, 5 captured, fp32,
SmolLM2 tokenizer), greedy, short prompts and responses. "loaded" is the RSS once the worker holds its target; the peak
count is then reset (Linux `clear_refs`) and "peak" is the process's peak RSS (VmHWM) over the task, so "task"
(peak - loaded) is what the task itself costs.
With `--before`, the same children run with that checkout first on the path (e.g. a `git worktree` of an older
commit), and the table gives after/before ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = (1, 2, 3, 4, 5)


def build_target(folder: Path) -> str:
    """A random Qwen3 (hidden 1024, 6 layers, tied head) with the embedded SmolLM2 tokenizer, saved as a folder."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from flashdraft.target import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(key)


def reset_peak() -> bool:
    """Start the peak-RSS count afresh (Linux: writing 5 to clear_refs resets VmHWM); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_mb() -> float:
    try:
        return _status_mb("VmHWM")
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def child(args) -> None:
    """One task in this process; prints {"loaded_mb", "peak_mb", "tokens", "code"} as JSON."""
    import pipeline.capture
    from flashdraft.config import DataConfig
    from flashdraft.prompts import PromptRecord
    from flashdraft.store import shard_name
    from pipeline.job import open_store
    from pipeline.worker import CaptureWorker

    try:
        from pipeline.settings import CaptureSettings, Task
    except ImportError:  # a checkout before pipeline/settings.py (--before)
        from pipeline.worker import CaptureSettings, Task

    words = "explain why the sky looks blue at noon and red at sunset in plain words please".split()
    asks = [" ".join(words[i % 7 : i % 7 + 6]) for i in range(args.child)]
    records = tuple(
        PromptRecord(f"b{i}", "bench", str(i), ({"role": "user", "content": ask},), "train")
        for i, ask in enumerate(asks)
    )
    data = DataConfig()
    settings = CaptureSettings(
        target=args.target,
        layer_ids=LAYERS,
        dtype="float32",
        device="cpu",
        mode="regenerate",
        turns="single",
        max_new_tokens=args.new_tokens,
        max_length=data.max_length,
        max_prompt_tokens=data.max_prompt_tokens,
        batch_size=args.batch_size,
        prefill_tokens="auto",
        gpu_memory_fraction=data.gpu_memory_fraction,
        sampling=data.sampling,
        seed=0,
        system_prompt=None,
        enable_thinking=None,
        thinking_share=None,
        trust_remote_code=False,
        torch_threads=args.threads,
    )
    store = Path(args.store)
    open_store(store, settings, sources=["bench"], store_options={})
    worker = CaptureWorker(str(store), settings)
    gc.collect()
    loaded = _status_mb("VmRSS") if reset_peak() else peak_mb()  # loading's own transient peak is not the task's
    info = worker.run(Task(shard_name(0), records))["info"]
    code = str(Path(pipeline.capture.__file__).resolve().parents[1])
    print(json.dumps({"loaded_mb": loaded, "peak_mb": peak_mb(), "tokens": info["tokens"], "code": code}))


def measure(code: Path, size: int, target: str, args, tmp: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [sys.executable, __file__, "--child", str(size), "--target", target, "--store", str(tmp / f"s{size}")]
    cmd += ["--new-tokens", str(args.new_tokens), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, cwd=code, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if Path(result["code"]) != code.resolve():
        raise RuntimeError(f"the child imported {result['code']}, not {code}")
    return result


def print_table(rows: dict, sizes: list[int], labels: list[str]) -> None:
    """One line a (code, size): peak, loaded, task; then the ratios across sizes and against 'before'."""
    print(f"{'code':8} {'prompts':>7} {'tokens':>7} {'peak MB':>8} {'loaded MB':>9} {'task MB':>8}")
    for label in labels:
        for n in sizes:
            r = rows[label, n]
            task = r["peak_mb"] - r["loaded_mb"]
            print(f"{label:8} {n:7d} {r['tokens']:7d} {r['peak_mb']:8.0f} {r['loaded_mb']:9.0f} {task:8.0f}")
    lo, hi = sizes[0], sizes[-1]
    for label in labels:
        ratio = rows[label, hi]["peak_mb"] / rows[label, lo]["peak_mb"]
        task = [max(1.0, rows[label, n]["peak_mb"] - rows[label, n]["loaded_mb"]) for n in (lo, hi)]
        print(f"{label}: peak {hi}/{lo} prompts = {ratio:.2f}x, task memory {hi}/{lo} = {task[1] / task[0]:.2f}x")
    if len(labels) == 2:
        for n in sizes:
            ratio = rows["after", n]["peak_mb"] / rows["before", n]["peak_mb"]
            print(f"after/before peak at {n} prompts = {ratio:.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--before", type=Path, help="an older checkout to measure first (e.g. a git worktree)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(REPO))
    codes = ([("before", args.before)] if args.before else []) + [("after", REPO)]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        target = build_target(tmp / "target")
        rows = {}
        for label, code in codes:
            for n in args.sizes:
                rows[label, n] = measure(Path(code), n, target, args, tmp / label)
                print(f"  {label} {n} prompts: {rows[label, n]}", file=sys.stderr, flush=True)
    print(f"batch {args.batch_size}, {args.new_tokens} new tokens, hidden 1024, 5 layers captured, bf16 store")
    print_table(rows, args.sizes, [label for label, _ in codes])


if __name__ == "__main__":
    main()
