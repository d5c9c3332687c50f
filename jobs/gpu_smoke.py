"""The Python pieces of jobs/gpu_smoke.sh. They need only the machine's Python with torch (plus what a stage imports);
nothing here imports torch before `preflight` has checked it.

python jobs/gpu_smoke.py preflight DEVICE WHEELHOUSE PLAN  # Python, torch, transformers, compiler, headers, wheels
python jobs/gpu_smoke.py install WHEELHOUSE SITE     # the wheels this Python lacks -> SITE (pip --target, no index)
python jobs/gpu_smoke.py target FOLDER               # a tiny random Qwen3 target with a tokenizer made in code
python jobs/gpu_smoke.py stage NAME WORK -m MODULE ARGS...   # python -m MODULE ARGS, its peak GPU memory recorded
python jobs/gpu_smoke.py report WORK RESULT DEVICE   # the figures -> RESULT (json); exit 1 on a lossy speculative
                                                     # run, a failed capture shard or a failed paper-shape check
"""

from __future__ import annotations

import atexit
import email.parser
import json
import os
import platform
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# The floors of what the machine brings (its own Python and torch; transformers may come from the wheelhouse):
PYTHON_FLOOR = (3, 11)  # zarr 3.1, datetime.UTC, tomllib
# torch: transformers 5 treats an older torch as absent; FlexAttention with enable_gqa, create_block_mask, SDPA's
# enable_gqa and torch.serialization.safe_globals, which the drafter, trainer and checkpoints use, are all in 2.6.
TORCH_FLOOR = "2.6"
# transformers 5.24 renamed the forward's `past_key_values` to `cache`: pipeline/decode.py passes `cache=` (an older
# transformers ignores the unknown keyword, decodes every step without the slot cache, and SlotCache then fails on an
# empty cache). DynamicLayer, activate_past_recording and from_pretrained(dtype=) are older (5.17 has them).
TRANSFORMERS_FLOOR = "5.24"
# The smoke's own modules beyond torch: the wheelhouse must make these importable.
SMOKE_IMPORTS = ("zarr", "numcodecs", "deepspeed", "hydra", "omegaconf", "transformers")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def release(version: str) -> tuple[int, ...]:
    """The numeric release at the start of a version string: '2.11.0+cu130' -> (2, 11, 0)."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in found[0].split(".")) if found else ()


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# --- the wheelhouse: what to install, from the wheels' own requirements ---------------------------------------------


@dataclass
class Wheel:
    path: Path
    name: str  # canonical
    version: object  # packaging.version.Version
    requires: list[str]  # Requires-Dist lines


def read_wheels(house: Path) -> dict[str, Wheel]:
    """The wheelhouse's wheels by canonical name, each with the requirements its METADATA lists."""
    from packaging.utils import parse_wheel_filename

    wheels = {}
    for path in sorted(house.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            headers = email.parser.HeaderParser().parsestr(z.read(meta).decode("utf-8", "replace"))
        wheels[name] = Wheel(path, name, version, headers.get_all("Requires-Dist") or [])
    return wheels


def house_roots(house: Path, wheels: dict[str, Wheel]) -> list[str]:
    """The set's roots (roots.txt, written by scripts/wheelhouse.py); every wheel where the folder has none."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    listed = house / "roots.txt"
    if not listed.is_file():
        return list(wheels)
    return [canonicalize_name(Requirement(line).name) for line in listed.read_text().split() if line.strip()]


def install_plan(house: Path) -> tuple[list[Wheel], list[str]]:
    """(wheels to install, problems). A root (the smoke's own modules) is installed where this Python lacks it or has
    an older version than the wheelhouse (the one CI tested); then, repeatedly, whatever an installed wheel requires
    that this Python lacks or has in a version the requirement excludes. A package the machine has in a version that
    satisfies every requirement is kept (its numpy, tokenizers, ... next to the carried transformers)."""
    from packaging.version import Version

    wheels = read_wheels(house)
    chosen: dict[str, Wheel] = {}
    for name in house_roots(house, wheels):
        have = installed(name)
        if name in wheels and (have is None or Version(have) < wheels[name].version):
            chosen[name] = wheels[name]
    problems: list[str] = []
    todo = [(w, ()) for w in chosen.values()]
    while todo:
        wheel, extras = todo.pop()
        for line in wheel.requires:
            added = _requirement(line, extras, wheel, wheels, chosen, problems, house)
            if added is not None:
                todo.append(added)
    return sorted(chosen.values(), key=lambda w: w.name), problems


def _requirement(line, extras, wheel, wheels, chosen, problems, house):
    """One requirement of `wheel` (its `extras` asked for): None when this Python or a chosen wheel satisfies it (or
    its marker excludes it here); else the wheelhouse's wheel for it, chosen, with the extras asked; else a problem."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    req = Requirement(line)
    if req.marker and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
        return None
    name = canonicalize_name(req.name)
    have = chosen[name].version if name in chosen else installed(name)
    try:
        have = Version(str(have)) if have is not None else None
    except InvalidVersion:
        have = None
    if have is not None and req.specifier.contains(have, prereleases=True):
        return None
    candidate = wheels.get(name)
    if name in chosen or candidate is None or not req.specifier.contains(candidate.version, prereleases=True):
        offer = f"{house.name} has {candidate.version}" if candidate else f"{house.name} has none"
        problems.append(f"{wheel.name} {wheel.version} needs {req}: this Python has {have or 'none'}, {offer}")
        return None
    chosen[name] = candidate
    return candidate, tuple(req.extras)


def install(wheelhouse: str, site: str) -> int:
    """Install what this Python lacks from WHEELHOUSE into SITE (no index, no dependency resolution by pip: the plan
    above is the resolution), then import the smoke's modules from it, transformers at its floor at least."""
    house = check_wheelhouse(Path(wheelhouse))
    wheels, problems = install_plan(house)
    if problems:
        raise SystemExit("gpu_smoke: the wheelhouse cannot satisfy:\n  " + "\n  ".join(problems))
    print(f"gpu_smoke: {len(wheels)} of {len(list(house.glob('*.whl')))} wheels from {house} into {site}")
    if wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*pip, "--upgrade", "--target", site, *(str(w.path) for w in wheels)], check=True)
    for w in wheels:
        print(f"  {w.name} {w.version}" + (f" (this Python has {installed(w.name)})" if installed(w.name) else ""))
    sys.path.insert(0, site)
    for module in SMOKE_IMPORTS:
        __import__(module)
    import transformers

    if release(transformers.__version__) < release(TRANSFORMERS_FLOOR):
        raise SystemExit(
            f"gpu_smoke: transformers {transformers.__version__} ({transformers.__file__}) after the install; "
            f"flashdraft needs >= {TRANSFORMERS_FLOOR}"
        )
    return 0


def check_wheelhouse(house: Path) -> Path:
    if not (house / "wheelhouse.json").is_file():
        raise SystemExit(
            f"gpu_smoke: {house} is not a wheelhouse (no wheelhouse.json): make it where an index is reachable with "
            f"`make wheelhouse SET=smoke PYTHON_VERSION={sys.version_info.major}.{sys.version_info.minor}`"
        )
    info = json.loads((house / "wheelhouse.json").read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if info["python_version"] != here:
        raise SystemExit(f"gpu_smoke: {house} holds wheels for Python {info['python_version']}, this is {here}")
    return house


# --- preflight: what the machine lacks, said before anything runs -----------------------------------------------------


def check_python() -> list[str]:
    if sys.version_info >= PYTHON_FLOOR:
        return []
    floor = ".".join(map(str, PYTHON_FLOOR))
    return [f"Python {platform.python_version()} ({sys.executable}): flashdraft needs >= {floor}; PY=... another"]


def check_torch(device: str, found: list[str]) -> list[str]:
    """torch importable, at its floor, and (DEVICE=cuda) a CUDA build that sees a GPU."""
    have = installed("torch")
    if have is None:
        return [f"no torch for {sys.executable}: run the smoke with the Python that holds the machine's torch (PY=...)"]
    if release(have) < release(TORCH_FLOOR):
        return [f"torch {have} is older than {TORCH_FLOOR}: use a Python with a newer torch (PY=...)"]
    import torch

    if device != "cuda":
        found.append(f"torch {have}")
        return []
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return [
            f"torch {have} ({build}) sees no GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES; DEVICE=cpu runs on CPU"
        ]
    n = torch.cuda.device_count()
    found.append(f"torch {have} (CUDA {torch.version.cuda}, {n} x {torch.cuda.get_device_name(0)})")
    return []


def check_compiler(work: Path) -> tuple[str, list[str]]:
    """(what was found, problems): the C compiler Triton builds its launchers with (CC, else gcc, else clang, as
    Triton looks) and the Python headers they include, tried on a one-line file."""
    given = os.environ.get("CC")
    cc = shutil.which(given) if given else shutil.which("gcc") or shutil.which("clang")
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme  # as Triton reads Debian's scheme
    header = Path(sysconfig.get_paths(scheme=scheme)["include"]) / "Python.h"
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    problems = []
    if not cc:
        where = f"CC={given} not found" if given else "CC unset, no gcc or clang on PATH"
        problems.append(f"no C compiler ({where}): install gcc (apt-get install gcc) or set CC")
    if not header.is_file():
        problems.append(f"no Python headers ({header} missing): install python{v}-dev, or use a Python that has them")
    if problems:
        return "", problems
    work.mkdir(parents=True, exist_ok=True)
    src = work / "preflight_python_h.c"
    src.write_text("#include <Python.h>\nint main(void) { return Py_IsInitialized(); }\n")
    tried = subprocess.run([cc, "-fsyntax-only", f"-I{header.parent}", str(src)], capture_output=True, text=True)
    if tried.returncode != 0:
        return "", [f"{cc} cannot compile a file that includes {header}: {tried.stderr.strip()[-400:]}"]
    return f"C compiler {cc}, {header}", []


def smoke_modules_missing() -> list[str]:
    import importlib.util

    return [m for m in SMOKE_IMPORTS if importlib.util.find_spec(m) is None]


def check_wheels(house: Path, found: list[str]) -> tuple[list[Wheel], list[str]]:
    """(the wheels to install, problems): the wheelhouse is needed where a smoke module is missing or this Python's
    transformers is below the floor; it is used, where present, for any root older than its own."""
    transformers = installed("transformers")
    old = transformers is None or release(transformers) < release(TRANSFORMERS_FLOOR)
    missing = [m for m in smoke_modules_missing() if m != "transformers"]
    needed = ([f"transformers >= {TRANSFORMERS_FLOOR} ({transformers or 'none'} here)"] if old else []) + missing
    if not (house / "wheelhouse.json").is_file():
        if not needed:
            return [], []
        v = f"{sys.version_info.major}.{sys.version_info.minor}"
        return [], [
            f"needed from a wheelhouse: {', '.join(needed)}; there is none at {house}: make it where an index is "
            f"reachable with `make wheelhouse SET=smoke PYTHON_VERSION={v}` and carry it along (or WHEELHOUSE=...)"
        ]
    try:
        check_wheelhouse(house)
        import packaging  # noqa: F401 - the plan reads requirements with it (transformers and pip bring it)
    except SystemExit as e:
        return [], [str(e).removeprefix("gpu_smoke: ")]
    except ImportError:
        return [], [f"no `packaging` for {sys.executable}, which reading the wheels' requirements takes"]
    wheels, problems = install_plan(house)
    carried = {w.name: w for w in wheels}.get("transformers")
    if old and (carried is None or release(str(carried.version)) < release(TRANSFORMERS_FLOOR)):
        problems.append(
            f"transformers {transformers} here is older than {TRANSFORMERS_FLOOR} and {house} brings none newer"
        )
    if not problems:
        line = f"{len(wheels)} wheels from {house.name}" + (f" ({', '.join(needed)})" if needed else "")
        found.append(line + (f": transformers {carried.version} over {transformers}" if carried else ""))
    return wheels, problems


def preflight(device: str, wheelhouse: str, plan: str) -> int:
    """Everything the smoke needs from the machine, checked before anything runs: every problem is printed with what
    to do, and the exit status is 1 if there is one. PLAN gets the wheels to install (empty: none)."""
    found = [f"Python {platform.python_version()} ({sys.executable})"]
    problems = check_python()
    if not problems:
        problems += check_torch(device, found)
    compiler, compile_problems = check_compiler(Path(plan).parent)
    found += [compiler] if compiler else []
    if device == "cuda":
        problems += [f"{p} (Triton, which torch.compile and FlexAttention use, needs it)" for p in compile_problems]
    else:  # the CPU stages run no torch.compile (train.compile=false)
        found += [f"not needed on DEVICE=cpu: {p}" for p in compile_problems]
    wheels, wheel_problems = check_wheels(Path(wheelhouse), found)
    problems += wheel_problems
    Path(plan).write_text("".join(f"{w.path}\n" for w in wheels))
    print("gpu_smoke: " + "; ".join(found))
    for p in problems:
        print(f"gpu_smoke: MISSING: {p}", file=sys.stderr)
    return 1 if problems else 0


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
    import torch
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
    import torch

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
    import torch

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
    """Tokens captured and the capture's own tokens/s (the fleet's summary: its wall, target load included), the
    shards committed and failed, and the worker's lines saying how it decodes (batch, overlap, writers)."""
    text = log.read_text()
    tokens = re.search(r"tokens (\d+) \((\d+) new\)", text)
    rate = re.search(r"wall ([\d.]+) s, (\d+) tokens/s", text)
    if not tokens or not rate:
        raise SystemExit(f"{log}: no capture summary (tokens, wall, tokens/s) found")
    shards = re.search(r"shards committed this run (\d+)", text)
    return {
        "tokens": int(tokens[2]),
        "wall_s": float(rate[1]),
        "tokens_per_s": int(rate[2]),
        "shards_committed": int(shards[1]) if shards else None,
        "failed_shards": re.findall(r"FAILED shard (\S+)", text),
        "worker": re.findall(r"capture worker \d+: ((?:decode|shard writing)[^\n]*)", text),
    }


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


def transformers_used() -> str:
    import transformers

    where = "the wheelhouse" if "/site/" in transformers.__file__ else "this Python's own"
    return f"{transformers.__version__} ({where})"


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def report(work: str, result: str, device: str) -> int:
    import torch

    work_dir = Path(work)
    train = training_figures(work_dir / "run" / "train" / "metrics.jsonl")
    eval_report = json.loads((work_dir / "run" / "eval" / "report.json").read_text())
    capture = capture_figures(work_dir / "capture.log")
    capture["settings"] = read_json(work_dir / "capture-settings.json")
    figures = {
        "device": device_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers_used(),
        "ranks": int((work_dir / "ranks").read_text()),
        "wall_s": stage_times(work_dir),
        "capture": capture,
        "train": train,
        "flex_vs_dense": flex_vs_dense(work_dir, train),
        "eval": eval_figures(eval_report),
        "peak_gpu_memory": peak_memory(work_dir),
        "paper_shapes": paper_figures(work_dir),
        "work": str(work_dir),
    }
    Path(result).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return verdict(figures)


def paper_figures(work: Path) -> dict | str | None:
    """The paper-shape check's JSON (jobs/gpu_paper_shapes.py; "error" where it failed after writing it), the tail
    of its log where it wrote none; None: not run."""
    if (work / "paper_shapes.json").is_file():
        return read_json(work / "paper_shapes.json")
    log = work / "paper.log"
    return "failed: " + log.read_text()[-1500:] if log.is_file() else None


def verdict(figures: dict) -> int:
    """0 when the speculative run was lossless, the capture lost no shard and the paper-shape check (if run) passed."""
    ev, capture, paper = figures["eval"], figures["capture"], figures["paper_shapes"]
    bad = []
    if ev["lossless"] is not True or not ev["tau"]:
        bad.append(f"dflash lossless={ev['lossless']} tau={ev['tau']}: not a lossless speculative run")
    if capture["failed_shards"]:
        bad.append(f"capture shards failed: {capture['failed_shards']}")
    if isinstance(paper, str) or (isinstance(paper, dict) and "error" in paper):
        bad.append("the paper-shape check failed (paper_shapes above)")
    for line in bad:
        print(f"gpu_smoke: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    commands = {"preflight": preflight, "install": install, "target": build_target, "stage": run_stage}
    commands["report"] = report
    if command not in commands:
        raise SystemExit(f"unknown command {command!r}: {' | '.join(commands)}")
    sys.exit(commands[command](*args))
