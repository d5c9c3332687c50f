"""The Python pieces of jobs/gpu_smoke.sh. They need torch and transformers only (plus what a stage imports):

python jobs/gpu_smoke.py install WHEELHOUSE SITE     # the wheels this Python lacks -> SITE (pip --target, no index)
python jobs/gpu_smoke.py target FOLDER               # a tiny random Qwen3 target with a tokenizer made in code
python jobs/gpu_smoke.py stage NAME WORK -m MODULE ARGS...   # python -m MODULE ARGS, its peak GPU memory recorded
python jobs/gpu_smoke.py report WORK RESULT DEVICE   # the figures -> RESULT (json); exit 1 unless lossless
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import re
import runpy
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

# The smoke's own modules beyond torch and transformers: the wheelhouse must make these importable.
SMOKE_IMPORTS = ("zarr", "numcodecs", "deepspeed", "hydra", "omegaconf")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _version_key(version: str):
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version)
    except InvalidVersion:
        return None


def wheels_to_install(wheelhouse: Path) -> list[Path]:
    """The wheelhouse's wheels whose distribution this Python lacks, or has only older: a package the machine already
    has at the wheelhouse's version or newer (numpy, pyyaml, ... next to its transformers) is kept."""
    from packaging.utils import parse_wheel_filename

    out = []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        try:
            have = _version_key(metadata.version(name))
        except metadata.PackageNotFoundError:
            have = None
        if have is None or have < version:
            out.append(wheel)
    return out


def install(wheelhouse: str, site: str) -> int:
    """Install what this Python lacks from WHEELHOUSE into SITE (no index, no dependency resolution: the wheelhouse
    holds the closure), then import the smoke's modules from it."""
    house = Path(wheelhouse)
    if not (house / "wheelhouse.json").is_file():
        raise SystemExit(
            f"gpu_smoke: {house} is not a wheelhouse (no wheelhouse.json): make it where an index is reachable with "
            f"`make wheelhouse SET=smoke PYTHON_VERSION={sys.version_info.major}.{sys.version_info.minor}`"
        )
    info = json.loads((house / "wheelhouse.json").read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if info["python_version"] != here:
        raise SystemExit(f"gpu_smoke: {house} holds wheels for Python {info['python_version']}, this is {here}")
    wheels = wheels_to_install(house)
    print(f"gpu_smoke: {len(wheels)} of {len(list(house.glob('*.whl')))} wheels from {house} into {site}")
    if wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*pip, "--upgrade", "--target", site, *map(str, wheels)], check=True)
    sys.path.insert(0, site)
    for module in SMOKE_IMPORTS:
        __import__(module)
    return 0


def make_tokenizer(folder: str):
    """A byte-level BPE over the offline prompts' text (no download), ChatML's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from flashdraft.prompts import load_prompts

    records = load_prompts("pydocs") + load_prompts("chatseeds")
    texts = [turn["content"] for r in records for turn in r.messages] + [t for r in records for t in r.followups]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def build_target(folder: str) -> None:
    """Qwen3 geometry (q/k norms, head_dim 64), 6 layers, hidden 256, random weights: its responses mostly run to
    `data.max_new_tokens`, repetitive enough for a drafter to learn in minutes. The embedding has one row more than
    the tokenizer has words: the drafter's mask token."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = make_tokenizer(folder)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok) + 1,
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


def record_peak_memory(path: Path) -> None:
    """At exit: this process's peak CUDA memory (allocated and reserved, the largest over its devices) -> path."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    devices = range(torch.cuda.device_count())
    peak = {
        "allocated_gib": max(torch.cuda.max_memory_allocated(d) for d in devices) / 2**30,
        "reserved_gib": max(torch.cuda.max_memory_reserved(d) for d in devices) / 2**30,
    }
    path.write_text(json.dumps(peak) + "\n")


def run_stage(name: str, work: str, dash_m: str, module: str, *args: str) -> None:
    """`python -m MODULE ARGS` in this process (a torchrun rank too), its peak GPU memory to WORK/peak-NAME-RANK."""
    if dash_m != "-m":
        raise SystemExit(f"usage: stage NAME WORK -m MODULE ARGS..., got {dash_m!r} for -m")
    rank = os.environ.get("RANK", "0")
    atexit.register(record_peak_memory, Path(work) / f"peak-{name}-{rank}.json")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()})"


def stage_times(work: Path) -> dict:
    lines = (work / "times").read_text().split("\n")
    return {name: round(float(s), 1) for name, s in (line.split() for line in lines if line.strip())}


def peak_memory(work: Path) -> dict | None:
    """{stage: peak GiB allocated / reserved (the largest rank's)}; None where no stage used a GPU."""
    out: dict = {}
    for path in sorted(work.glob("peak-*.json")):
        stage = path.stem.split("-")[1]
        peak = json.loads(path.read_text())
        prev = out.get(stage, {"allocated_gib": 0.0, "reserved_gib": 0.0})
        out[stage] = {k: round(max(prev[k], v), 3) for k, v in peak.items()}
    return out or None


def capture_figures(log: Path) -> dict:
    """Tokens captured and the capture's own tokens/s (the fleet's summary line: its wall, target load included)."""
    text = log.read_text()
    tokens = re.search(r"tokens (\d+) \((\d+) new\)", text)
    rate = re.search(r"wall ([\d.]+) s, (\d+) tokens/s", text)
    if not tokens or not rate:
        raise SystemExit(f"{log}: no capture summary (tokens, wall, tokens/s) found")
    return {"tokens": int(tokens[2]), "wall_s": float(rate[1]), "tokens_per_s": int(rate[2])}


def training_figures(metrics: Path) -> dict:
    """Step time and tokens/s: medians over the steps after the first fifth (compilation, warm-up)."""
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [m for m in steps if "step_time_s" in m]
    if not steps:
        raise SystemExit(f"{metrics}: no training steps logged")
    timed = steps[len(steps) // 5 :] or steps
    return {
        "steps": len(steps),
        "step_time_s": round(statistics.median(m["step_time_s"] for m in timed), 4),
        "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in timed)),
        "loss_first": round(steps[0]["loss"], 4),
        "loss_last": round(steps[-1]["loss"], 4),
    }


def flex_vs_dense(work: Path, train: dict) -> dict | None:
    """The flex-attention run's median step time against the dense run's (same settings, fewer steps)."""
    dense_metrics = work / "run" / "train-dense" / "metrics.jsonl"
    if not dense_metrics.is_file():
        return None
    dense = training_figures(dense_metrics)
    return {
        "flex_step_time_s": train["step_time_s"],
        "dense_step_time_s": dense["step_time_s"],
        "dense_over_flex": round(dense["step_time_s"] / train["step_time_s"], 3),
    }


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def eval_figures(eval_report: dict) -> dict:
    methods = eval_report["methods"]
    dflash = methods["dflash"]
    settings = eval_report.get("settings", {})
    return {
        "tau": rounded(dflash["tau"]),
        "lossless": dflash["lossless"],
        "exact": settings.get("exact"),
        "speedup": rounded(dflash["speedup"]),
        "dflash_tokens_per_s": rounded(dflash["tokens_per_s"]),
        "plain_tokens_per_s": rounded(methods["plain"]["tokens_per_s"]),
    }


def report(work: str, result: str, device: str) -> int:
    work_dir = Path(work)
    train = training_figures(work_dir / "run" / "train" / "metrics.jsonl")
    eval_report = json.loads((work_dir / "run" / "eval" / "report.json").read_text())
    figures = {
        "device": device_name(device),
        "torch": torch.__version__,
        "ranks": int((work_dir / "ranks").read_text()),
        "wall_s": stage_times(work_dir),
        "capture": capture_figures(work_dir / "capture.log"),
        "train": train,
        "flex_vs_dense": flex_vs_dense(work_dir, train),
        "eval": eval_figures(eval_report),
        "peak_gpu_memory": peak_memory(work_dir),
        "work": str(work_dir),
    }
    Path(result).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    ev = figures["eval"]
    if ev["lossless"] is not True or not ev["tau"]:
        print(f"gpu_smoke: dflash lossless={ev['lossless']} tau={ev['tau']}: not a lossless speculative run")
        return 1
    return 0


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    commands = {"install": install, "target": build_target, "stage": run_stage, "report": report}
    if command not in commands:
        raise SystemExit(f"unknown command {command!r}: {' | '.join(commands)}")
    sys.exit(commands[command](*args))
