"""A drafter served in llama.cpp: plain decoding against `--spec-type draft-dflash` on the eval prompts (start of #40).

    .venv/bin/python benchmarks/bench_llamacpp.py [--drafter runs/quick-smollm2-135m/drafter] [--target smollm2-135m]
        [--sources humaneval mtbench] [--limit 2] [--max-new-tokens 64] [--threads 2] [--draft-n-max N]
        [--modes plain dflash ngram-simple ...]

Builds llama.cpp once into the cache and converts the drafter and its target to GGUF (benchmarks/llamacpp.py), then
for each held-out prompt (rendered with the target's chat template, as the harness does) runs, greedy
(`--temp 0 --top-k 1`):
  plain   llama-completion, llama.cpp's own plain decoding (tokens/s from its `eval time` line: the decode steps after
          the prompt, the first token excluded);
  dflash  llama-speculative-simple with the drafter, `--spec-type draft-dflash --spec-draft-n-max N` (N defaults to
          the drafter's block size - 1);
  any other name: llama-speculative-simple `--spec-type NAME` with no drafter (llama.cpp's n-gram types).
For speculative modes, tokens/s is from its `decoded N tokens in T seconds` line (the whole decode loop), and the
rounds are n_predict - n_accept (each round commits its accepted drafts plus one target token), so
tau = n_predict / rounds, accepted a round = n_accept / rounds. Each mode also reports how many characters of its
text agree with plain decoding's (greedy output must be identical).

Not done yet (see the issue): the harness's own figures for the same drafter and prompts next to these, token-level
parity with the harness (tokens until the first difference, acceptance per round on the agreeing stretch), n-gram
parameters tuned per type, and the README rows.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import llamacpp

import flashdraft.target as ft
from flashdraft.prompts import load_prompts

PLAIN_EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs")
SPEC_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
SPEC_COUNT = re.compile(r"^.*\b(n_predict|n_drafted|n_accept)\s*=\s*(\d+)", re.MULTILINE)


def common_flags(args) -> list[str]:
    """Flags every mode gets, so the rows differ only in how tokens are drafted."""
    flags = ["-n", str(args.max_new_tokens), "--temp", "0", "--top-k", "1", "-t", str(args.threads)]
    # The default batch (2048) made llama-speculative-simple several times slower per step than with 256 here, and
    # its draft-dflash path with flash attention off slower still: batch and flash attention are set for every mode.
    flags += ["-c", str(args.ctx_size), "-b", str(args.prompt_batch), "-ub", str(args.prompt_batch)]
    return flags + ["-fa", args.flash_attn]


def run_plain(tools: dict, target_gguf: Path, prompt_file: Path, args) -> dict:
    cmd = [str(tools["llama-completion"]), "-m", str(target_gguf), "-f", str(prompt_file)]
    cmd += common_flags(args)
    cmd += ["-no-cnv", "--no-display-prompt"]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed:\n{proc.stderr[-2000:]}")
    # The prompt-eval line also says "eval time"; the plain decode line is the one that counts "runs".
    ms, runs = PLAIN_EVAL.findall(proc.stderr)[-1]
    # llama-completion prints a newline before the generated text (the prompt is not displayed).
    text = proc.stdout[1:] if proc.stdout.startswith("\n") else proc.stdout
    # Timed tokens are the decode steps after the prompt (the first token comes from the prompt's forward pass).
    return {
        "text": text.rstrip("\n"),
        "tokens": int(runs),
        "seconds": float(ms) / 1000,
        "tokens_per_s": int(runs) / (float(ms) / 1000),
    }


def run_speculative(tools: dict, gguf: dict, prompt_file: Path, spec_type: str, args, prompt_text: str) -> dict:
    cmd = [str(tools["llama-speculative-simple"]), "-m", str(gguf["target"]), "-f", str(prompt_file)]
    cmd += common_flags(args)
    cmd += ["--spec-type", spec_type]
    if spec_type.startswith("draft-"):
        cmd += ["-md", str(gguf["drafter"]), "--spec-draft-n-max", str(args.draft_n_max)]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    tokens, seconds = SPEC_DECODED.search(proc.stderr).groups()
    counts = {name: int(value) for name, value in SPEC_COUNT.findall(proc.stderr)}
    rounds = counts["n_predict"] - counts["n_accept"]
    # The tool echoes the prompt before the generated text, after two blank lines.
    text = proc.stdout.lstrip("\n")
    text = text[len(prompt_text) :] if text.startswith(prompt_text) else text
    return {
        "text": text.rstrip("\n"),
        "tokens": counts["n_predict"],
        "seconds": float(seconds),
        "tokens_per_s": int(tokens) / float(seconds),
        "rounds": rounds,
        "accepted": counts["n_accept"],
        "drafted": counts["n_drafted"],
    }


def common_prefix(a: str, b: str) -> int:
    """Characters of `a` and `b` that agree from the start (the runs stop at different lengths: compare the shorter)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="runs/quick-smollm2-135m/drafter")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sources", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--limit", type=int, default=2, help="held-out prompts per source")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-n-max", type=int, default=None, help="default: the drafter's block size - 1")
    ap.add_argument("--modes", nargs="+", default=["plain", "dflash"], help="plain, dflash, or a --spec-type name")
    ap.add_argument("--batch", type=int, default=256, help="-b and -ub for every mode (the prompt must fit)")
    ap.add_argument("--ctx-size", type=int, default=2048, help="-c for every mode")
    ap.add_argument("--flash-attn", default="on", choices=["on", "off", "auto"], help="-fa for every mode")
    ap.add_argument("--gguf-dir", default=None, help="default: gguf/ next to the drafter folder")
    ap.add_argument("--outtype", default="f32")
    ap.add_argument("--jobs", type=int, default=None, help="compile jobs for the one-time build")
    ap.add_argument("--json", default=None, help="also write every run's figures here")
    args = ap.parse_args()

    tools = llamacpp.build(("llama-speculative-simple", "llama-completion"), jobs=args.jobs)
    gguf = llamacpp.export_gguf(args.drafter, args.target, args.gguf_dir, args.outtype)
    if args.draft_n_max is None:
        block_size = json.loads((Path(args.drafter) / "config.json").read_text()).get("block_size", 16)
        args.draft_n_max = block_size - 1
    tokenizer = ft.load_tokenizer(args.target)
    records = [r for source in args.sources for r in load_prompts(source, split="heldout", limit=args.limit)]

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        for i, record in enumerate(records):
            prompt_text = ft.chat_text(tokenizer, list(record.messages))
            prompt_file = Path(tmp) / f"prompt{i}.txt"
            prompt_file.write_text(prompt_text)
            # llama-speculative-simple wants the whole prompt in one batch: raise the batch to fit, in steps of 64.
            n_prompt = len(tokenizer(prompt_text, add_special_tokens=False).input_ids)
            run_args = argparse.Namespace(**vars(args), prompt_batch=max(args.batch, (n_prompt + 16 + 63) // 64 * 64))
            plain = None
            for mode in args.modes:
                if mode == "plain":
                    result = run_plain(tools, gguf["target"], prompt_file, run_args)
                    plain = result
                else:
                    spec_type = "draft-dflash" if mode == "dflash" else mode
                    result = run_speculative(tools, gguf, prompt_file, spec_type, run_args, prompt_text)
                agree = common_prefix(result["text"], plain["text"]) if plain else None
                result.update(prompt=i, source=record.source, mode=mode, agree_chars=agree)
                runs.append(result)
                tau = f"tau {result['tokens'] / result['rounds']:.2f}" if "rounds" in result else "tau -"
                print(
                    f"prompt {i} {record.source:<10} {mode:<14} {result['tokens_per_s']:7.2f} tok/s  {tau:<9} "
                    f"tokens {result['tokens']:4d}  agree {agree if agree is not None else '-'}"
                    f"/{min(len(plain['text']), len(result['text'])) if plain else '-'} chars",
                    flush=True,
                )

    print("\nmode            tok/s   tau   accepted/round  (totals over prompts; tok/s = tokens / decode seconds)")
    for mode in args.modes:
        rows = [r for r in runs if r["mode"] == mode]
        seconds = sum(r["seconds"] for r in rows)
        tokens = sum(r["tokens"] for r in rows)
        line = f"{mode:<14} {tokens / seconds:7.2f}"
        if "rounds" in rows[0]:
            rounds = sum(r["rounds"] for r in rows)
            line += f"  {tokens / rounds:5.2f}  {sum(r['accepted'] for r in rows) / rounds:6.2f}"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    sys.exit(main())
