"""A drafter served in llama.cpp against llama.cpp's plain decoding, its n-gram modes and the harness (#40).

    .venv/bin/python benchmarks/bench_llamacpp.py [--drafter runs/quick-smollm2-135m/drafter] [--model smollm2-135m]
        [--sources humaneval mtbench] [--limit 4] [--max-new-tokens 64] [--threads 2]
        [--modes plain dflash ngram-simple ngram-map-k ngram-mod] [--no-harness]
    make bench-llamacpp [ARGS="--limit 2"]

Builds llama.cpp once into the cache and converts the drafter and its target to GGUF (harness/llamacpp.py), then
for each held-out prompt (rendered with the target's chat template, as the harness renders it) runs, greedy
(`--temp 0 --top-k 1`), with the same batch, context, flash-attention and thread flags:
  plain   llama-completion, llama.cpp's own plain decoding (tokens/s from its `eval time` line: the decode steps after
          the prompt);
  dflash  llama-speculative-simple with the drafter, `--spec-type draft-dflash --spec-draft-n-max N` (N: the
          drafter's block size - 1, as the harness drafts);
  other   llama-speculative-simple `--spec-type NAME` with no drafter (llama.cpp's n-gram types, default settings).
For speculative modes tokens/s is from `decoded N tokens in T seconds` (the whole decode loop) and tau is committed
tokens a target forward, read round by round from its debug log (`accepted A/D draft tokens`: A + 1 committed).

Then the harness runs plain and dflash on the same prompts, same drafter, same thread count, the target in float32
as llama.cpp's f32 GGUF holds it, the drafter scoring every word (eval.draft_vocab=0, as llama.cpp's drafter does),
and the parity check compares the two independent implementations:
  - tokens of llama.cpp's output (its text tokenized by the target's tokenizer) that equal the harness's plain
    output before the first difference;
  - rounds: where a round of llama.cpp's dflash and one of the harness's start at the same position within the
    stretch both outputs agree on, they see the same context, so the same drafter must commit the same number of
    tokens; the count of such rounds and of those that match is printed. (The rounds do not line up from the start:
    the harness takes the first token from the prefill and drafts after it, llama.cpp drafts from the prompt's
    last token; docs/serving.md, "llama.cpp's rounds against ours". A run's last round may differ: the harness
    stops at the token limit, llama.cpp once past it.)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm

import flashdraft.target as ft
from flashdraft.config import ChatConfig
from flashdraft.prompts import load_prompts
from harness import llamacpp  # llama.cpp's build, GGUF conversion and serving, shared with the gate's llama.cpp leg
from harness.llamacpp import common_flags, common_prefix, round_parity, run_speculative, write_prompt_file

PLAIN_EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs")


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


def harness_runs(args, records) -> dict[tuple[str, str], dict]:
    """The harness's plain and dflash on the same prompts (float32 target, every word scored, the bench's threads);
    {(source, record_id): its runs.jsonl record}."""
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-harness-") as out:
        cmd = [sys.executable, "-m", "harness", f"model={args.model}", f"eval.prompts=[{','.join(args.sources)}]"]
        cmd += [f"eval.limit={args.limit}", f"eval.max_new_tokens={args.max_new_tokens}", "eval.turns=single"]
        cmd += ["eval.methods=[plain,dflash]", f"eval.drafter={Path(args.drafter).resolve()}", "eval.draft_vocab=0"]
        cmd += [f"eval.out_dir={out}", f"eval.num_threads={args.threads}", "model.dtype=float32", "eval.resume=false"]
        print("harness:", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        lines = Path(out, "runs.jsonl").read_text().splitlines()
    runs = {(r["source"], r["record_id"]): r for r in map(json.loads, lines)}
    missing = [f"{r.source}/{r.record_id}" for r in records if (r.source, r.record_id) not in runs]
    if missing:
        raise RuntimeError(f"the harness did not run {missing}")
    return runs


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="runs/quick-smollm2-135m/drafter")
    ap.add_argument("--model", default="smollm2-135m", help="conf/model/<name>.yaml: the target and its chat settings")
    ap.add_argument("--sources", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--limit", type=int, default=4, help="held-out prompts per source (the quick eval's)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-n-max", type=int, default=None, help="default: the drafter's block size - 1")
    ap.add_argument("--modes", nargs="+", default=["plain", "dflash", "ngram-simple", "ngram-map-k", "ngram-mod"])
    ap.add_argument("--no-harness", action="store_true", help="llama.cpp only: no harness rows, no parity check")
    ap.add_argument("--batch", type=int, default=256, help="-b and -ub for every mode (raised to fit the prompt)")
    ap.add_argument("--ctx-size", type=int, default=2048, help="-c for every mode")
    ap.add_argument("--flash-attn", default="on", choices=["on", "off", "auto"], help="-fa for every mode")
    ap.add_argument("--gguf-dir", default=None, help="default: gguf/ next to the drafter folder")
    ap.add_argument("--outtype", default="f32")
    ap.add_argument("--jobs", type=int, default=None, help="compile jobs for the one-time build")
    ap.add_argument("--json", default=None, help="also write every run's figures here")
    return ap.parse_args()


def model_conf(name: str) -> tuple[str, dict]:
    """(target, chat settings) of conf/model/<name>.yaml, so prompts render as the harness renders them."""
    conf = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / f"{name}.yaml")
    chat = OmegaConf.merge(OmegaConf.structured(ChatConfig), conf.get("chat") or {})
    return conf.target, {"system_prompt": chat.system_prompt, "enable_thinking": chat.enable_thinking}


def run_modes(tools, gguf, prompt_text: str, n_prompt: int, tmp: Path, args) -> dict:
    """Every mode of `args.modes` on one prompt: {mode: figures}; dflash once more with its round log."""
    prompt_file = write_prompt_file(tmp / "prompt.txt", prompt_text)  # `prompt_text + "\n"`: -f drops one
    # llama-speculative-simple wants the whole prompt in one batch: raise the batch to fit, in steps of 64.
    run_args = argparse.Namespace(**vars(args), prompt_batch=max(args.batch, (n_prompt + 16 + 63) // 64 * 64))
    results = {}
    for mode in args.modes:
        if mode == "plain":
            results[mode] = run_plain(tools, gguf["target"], prompt_file, run_args)
        else:
            spec_type = "draft-dflash" if mode == "dflash" else mode
            results[mode] = run_speculative(tools, gguf, prompt_file, spec_type, run_args, prompt_text)
    if "dflash" in results and not args.no_harness:  # the debug log is a separate, untimed run
        logged = run_speculative(
            tools, gguf, prompt_file, "draft-dflash", argparse.Namespace(**vars(run_args), rounds_log=True), prompt_text
        )
        results["dflash"]["round_lengths"] = logged["round_lengths"]
    return results


def parity(results: dict, harness: dict, tokenizer) -> dict:
    """Tokens each llama.cpp mode shares with the harness's plain output, and the dflash round check."""
    plain = harness["methods"]["plain"]["tokens"]
    ids = {mode: tokenizer(r["text"], add_special_tokens=False).input_ids for mode, r in results.items()}
    out = {mode: {"agree": common_prefix(t, plain), "of": min(len(t), len(plain))} for mode, t in ids.items()}
    if "dflash" in results and "round_lengths" in results["dflash"]:
        ours = harness["methods"]["dflash"]
        agree = common_prefix(ids["dflash"], ours["tokens"])
        shared, equal = round_parity(ours["acceptance_lengths"], results["dflash"]["round_lengths"], agree)
        out["rounds"] = {"agree": agree, "shared": shared, "equal": equal}
    return out


def print_totals(rows: list[dict], args) -> None:
    print("\nengine    mode            tok/s    tau  (totals over prompts; tok/s = decode tokens / decode seconds)")
    for mode in args.modes:
        mine = [r["llama"][mode] for r in rows]
        line = f"llama.cpp {mode:<14} {sum(m['tokens'] for m in mine) / sum(m['seconds'] for m in mine):7.2f}"
        if "rounds" in mine[0]:
            line += f"  {sum(m['tokens'] for m in mine) / sum(m['rounds'] for m in mine):5.2f}"
        print(line)
    if args.no_harness:
        return
    for method in ("plain", "dflash"):
        ms = [r["harness"]["methods"][method] for r in rows]
        tokens = sum(sum(m["acceptance_lengths"]) for m in ms)
        rounds = sum(len(m["acceptance_lengths"]) for m in ms)
        print(f"harness   {method:<14} {tokens / sum(m['decode_s'] for m in ms):7.2f}  {tokens / rounds:5.2f}")
    agree = {
        m: (sum(r["parity"][m]["agree"] for r in rows), sum(r["parity"][m]["of"] for r in rows)) for m in args.modes
    }
    print("\nparity with the harness's plain output (tokens before the first difference / tokens compared):")
    print("  " + ", ".join(f"{m} {a}/{n}" for m, (a, n) in agree.items()))
    if "dflash" in args.modes:
        shared = sum(r["parity"]["rounds"]["shared"] for r in rows)
        equal = sum(r["parity"]["rounds"]["equal"] for r in rows)
        print(
            f"dflash rounds starting at the same position on the agreeing stretch: {shared}; "
            f"same tokens committed: {equal}"
        )


def main() -> None:
    args = parse_args()
    target, chat = model_conf(args.model)
    tools = llamacpp.build(("llama-speculative-simple", "llama-completion"), jobs=args.jobs)
    gguf = llamacpp.export_gguf(args.drafter, target, args.gguf_dir, args.outtype)
    if args.draft_n_max is None:
        block_size = json.loads((Path(args.drafter) / "config.json").read_text()).get("block_size", 16)
        args.draft_n_max = block_size - 1
    tokenizer = ft.load_tokenizer(target)
    records = [r for source in args.sources for r in load_prompts(source, split="heldout", limit=args.limit)]
    harness = {} if args.no_harness else harness_runs(args, records)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        for record in tqdm(records, desc="llama.cpp", unit="prompt"):
            prompt_text = ft.chat_text(tokenizer, list(record.messages), **chat)
            n_prompt = len(tokenizer(prompt_text, add_special_tokens=False).input_ids)
            row = {"source": record.source, "record_id": record.record_id, "prompt_tokens": n_prompt}
            row["llama"] = run_modes(tools, gguf, prompt_text, n_prompt, Path(tmp), args)
            if harness:
                row["harness"] = harness[(record.source, record.record_id)]
                if row["harness"]["prompt_tokens"] != n_prompt:
                    raise RuntimeError(
                        f"{record.source}/{record.record_id}: the harness's prompt has "
                        f"{row['harness']['prompt_tokens']} tokens, this one {n_prompt}"
                    )
                row["parity"] = parity(row["llama"], row["harness"], tokenizer)
            rows.append(row)
    print_totals(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
