"""The two pieces of jobs/gpu_smoke.sh that are Python:

python jobs/gpu_smoke.py target FOLDER              # a tiny random Qwen3 target with the SmolLM2 tokenizer
python jobs/gpu_smoke.py report WORK RESULT DEVICE  # the figures -> RESULT (json); exit 1 unless lossless
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path

import torch


def build_target(folder: str) -> None:
    """Qwen3 geometry (q/k norms, head_dim 64), 6 layers, hidden 256, random weights: its responses mostly run to
    `data.max_new_tokens`, repetitive enough for a drafter to learn in minutes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from flashdraft.target import load_tokenizer

    tok = load_tokenizer("smollm2-135m")  # the embedded default's: no network
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()})"


def stage_times(work: Path) -> dict:
    lines = (work / "times").read_text().split("\n")
    return {name: round(float(s), 1) for name, s in (line.split() for line in lines if line.strip())}


def training_figures(metrics: Path) -> dict:
    """steps/s and tokens/s: medians over the steps after the first fifth (compilation, warm-up)."""
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [m for m in steps if "step_time_s" in m]
    if not steps:
        raise SystemExit(f"{metrics}: no training steps logged")
    timed = steps[len(steps) // 5 :] or steps
    return {
        "steps": len(steps),
        "steps_per_s": round(1 / statistics.median(m["step_time_s"] for m in timed), 2),
        "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in timed)),
        "loss_first": round(steps[0]["loss"], 4),
        "loss_last": round(steps[-1]["loss"], 4),
    }


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def report(work: str, result: str, device: str) -> int:
    work_dir = Path(work)
    eval_report = json.loads((work_dir / "run" / "eval" / "report.json").read_text())
    methods = eval_report["methods"]
    dflash = methods["dflash"]
    figures = {
        "device": device_name(device),
        "torch": torch.__version__,
        "ranks": int((work_dir / "ranks").read_text()),
        "wall_s": stage_times(work_dir),
        "train": training_figures(work_dir / "run" / "train" / "metrics.jsonl"),
        "eval": {
            "tau": rounded(dflash["tau"]),
            "lossless": dflash["lossless"],
            "speedup": rounded(dflash["speedup"]),
            "dflash_tokens_per_s": rounded(dflash["tokens_per_s"]),
            "plain_tokens_per_s": rounded(methods["plain"]["tokens_per_s"]),
        },
        "work": str(work_dir),
    }
    Path(result).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    if dflash["lossless"] is not True or not dflash["tau"]:
        print(f"gpu_smoke: dflash lossless={dflash['lossless']} tau={dflash['tau']}: not a lossless speculative run")
        return 1
    return 0


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "target":
        build_target(*args)
    elif command == "report":
        sys.exit(report(*args))
    else:
        raise SystemExit(f"unknown command {command!r}: target FOLDER | report WORK RESULT DEVICE")
