"""Evaluation: plain decoding, prompt lookup and DFlash on the same prompts, summarised.

Methods
  plain          the harness loop at block size 1: KV cache, one target forward per token
  plain_as_loaded  the same loop on the target as loaded, without the exact verification the harness gives it on
                 CPU (unpadded GEMMs, SDPA): the plain decoding a user runs; its `lossless` says whether its tokens
                 equal the exact target's, and every method's `speedup_vs_loaded` is over it
  prompt_lookup  transformers generate(prompt_lookup_num_tokens=10), the free baseline
  dflash         the harness loop with the drafter, one chain verified a round (the reference)
  dflash_tree    the same drafter, a tree of its most probable candidates verified a round (greedy only)
  dflash_lookup  dflash_tree, but a round whose newest `lookup_ngram` tokens occurred before verifies what
                 followed them (up to prompt_lookup_num_tokens) instead of running the drafter (greedy only)
  dflash_datastore  dflash_lookup, and a round without such a match verifies the continuation of its newest
                 `datastore_ngram` (down to `datastore_min_ngram`) tokens in the target's responses to the training prompts (harness/datastore.py),
                 where there is a confident one, before it runs the drafter (greedy only)
Decode time excludes the prefill (the prompt forward that emits the first token) for every
method; speedup is decode throughput over plain decoding's on the same prompts, which for greedy
(identical outputs) is plain decode wall time / method decode wall time.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft.model import DFlashDrafter, make_draft_config
from flashdraft.prompts import load_prompts
from flashdraft.target import chat_input_ids, choose_mask_token, target_layer_ids
from harness.prompt_lookup import prompt_lookup_generate
from harness.speculative import Generation, speculative_generate

METHODS = ("plain", "plain_as_loaded", "prompt_lookup", "dflash", "dflash_tree", "dflash_lookup", "dflash_datastore")
DRAFTER_METHODS = ("dflash", "dflash_tree", "dflash_lookup", "dflash_datastore")
GREEDY_ONLY = ("dflash_tree", "dflash_lookup", "dflash_datastore")
LOOKUP_METHODS = ("dflash_lookup", "dflash_datastore")
UNTRAINED_WARNING = (
    "UNTRAINED DRAFTER: no drafter checkpoint was found, so a randomly initialised one was measured. "
    "tau and speedup say nothing about a trained drafter; losslessness still holds."
)


@dataclass(frozen=True)
class EvalPrompt:
    source: str
    record_id: str
    input_ids: list[int]
    seq_id: str = ""  # the record's id in feature stores (flashdraft.prompts.sequence_id)


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    block_size: int | None = None  # None: the drafter's
    prompt_lookup_num_tokens: int = 10
    draft_cutoff: float = 0.0  # dflash: verify the draft prefix of cumulative draft probability >= this (0: all)
    verify_ms: tuple[float, ...] | None = None  # dflash*: the measured cost of a verify of 1, 2, ... rows; the chain's prefix and the trees' first nodes verified are chosen by it
    tree_size: int = 7  # dflash_tree: draft candidates verified a round
    tree_branching: int = 4  # dflash_tree: candidate tokens a block position
    lookup_ngram: int = 3  # dflash_lookup: a round verifies a lookup draft where the newest this-many tokens occurred before
    datastore_ngram: int = 4  # dflash_datastore: the datastore continues the newest this-many tokens
    datastore_min_ngram: int = 2  # dflash_datastore: ... or, backing off, as few as this many
    datastore_min_count: int = 2  # dflash_datastore: ... with a token that followed them at least this often
    seed: int = 0


def build_prompts(tokenizer, sources, *, split="heldout", limit=None, system_prompt=None, enable_thinking=None) -> list[EvalPrompt]:
    """Chat-templated prompts, `limit` per source; MT-Bench and other multi-turn sources: first turn."""
    prompts = []
    for source in [sources] if isinstance(sources, str) else list(sources):
        records = load_prompts(source, split=None if split == "all" else split, limit=limit)
        if not records:
            raise ValueError(f"prompt source {source!r} has no {split!r} prompts")
        for r in records:
            ids = chat_input_ids(tokenizer, list(r.messages), enable_thinking=enable_thinking, system_prompt=system_prompt)
            prompts.append(EvalPrompt(r.source, r.record_id, ids, r.seq_id))
    return prompts


def load_drafter(path, target, tokenizer, *, allow_untrained=False, num_layers=5, block_size=16, layer_ids=None,
                 num_target_features=5, intermediate_size=None, seed=0) -> tuple[DFlashDrafter, bool]:
    """(drafter, untrained): the checkpoint at `path`, or a random one when allowed and there is none."""
    dtype, device = target.dtype, target.device
    if path and (Path(path) / "config.json").is_file():
        drafter = DFlashDrafter.from_pretrained(path, dtype=dtype, device=device)
        check_drafter_fits(drafter, target, path)
        return drafter, False
    if not allow_untrained:
        raise FileNotFoundError(
            f"no drafter at {path!r} (config.json missing): train one (make train) or pass eval.drafter=PATH; "
            "eval.allow_untrained=true measures an untrained random drafter instead"
        )
    torch.manual_seed(seed)
    config = make_draft_config(
        target.config,
        mask_token_id=choose_mask_token(tokenizer, target.config.vocab_size),
        num_draft_layers=num_layers,
        block_size=block_size,
        target_layer_ids=target_layer_ids(target.config, num_target_features, layer_ids),
        intermediate_size=intermediate_size,
    )
    return DFlashDrafter(config).to(device=device, dtype=dtype).eval().requires_grad_(False), True


def check_drafter_fits(drafter, target, path) -> None:
    tc = getattr(target.config, "text_config", None) or target.config
    dc = drafter.config
    problems = [
        f"{key} {getattr(dc, key)} != target's {getattr(tc, key)}"
        for key in ("hidden_size", "vocab_size")
        if getattr(dc, key) != getattr(tc, key)
    ]
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {tc.num_hidden_layers} layers")
    if problems:
        raise ValueError(f"drafter {path} does not fit the target: " + "; ".join(problems))


def run_method(method, target, prompt: EvalPrompt, settings: DecodeSettings, *, proposer=None, datastore=None, stop_token_ids=(), seed=0,
               loaded_target=None) -> Generation:
    """`loaded_target`: the target without exact verification, for plain_as_loaded (None: `target` itself)."""
    common = dict(
        max_new_tokens=settings.max_new_tokens, stop_token_ids=stop_token_ids,
        temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
    )
    if method == "prompt_lookup":
        torch.manual_seed(seed)
        return prompt_lookup_generate(target, prompt.input_ids, num_lookup_tokens=settings.prompt_lookup_num_tokens, **common)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    if method in ("plain", "plain_as_loaded"):
        model = loaded_target if method == "plain_as_loaded" and loaded_target is not None else target
        return speculative_generate(model, prompt.input_ids, block_size=1, generator=generator, **common)
    if method == "dflash":
        return speculative_generate(
            target, prompt.input_ids, proposer=proposer, block_size=settings.block_size, generator=generator,
            draft_cutoff=settings.draft_cutoff, verify_ms=settings.verify_ms, **common,
        )
    if method == "dflash_tree":
        return speculative_generate(
            target, prompt.input_ids, proposer=proposer, block_size=settings.block_size, generator=generator,
            tree_size=settings.tree_size, tree_branching=settings.tree_branching, verify_ms=settings.verify_ms, **common,
        )
    if method in LOOKUP_METHODS:
        if method == "dflash_datastore" and datastore is None:
            raise ValueError("method dflash_datastore needs a datastore (eval.datastore: the training feature store)")
        return speculative_generate(
            target, prompt.input_ids, proposer=proposer, block_size=settings.block_size, generator=generator,
            tree_size=settings.tree_size, tree_branching=settings.tree_branching, lookup_ngram=settings.lookup_ngram,
            lookup_tokens=settings.prompt_lookup_num_tokens, datastore=datastore if method == "dflash_datastore" else None,
            verify_ms=settings.verify_ms, **common,
        )
    raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


def finished_records(log_path, run_key: str, seq_ids) -> dict[str, dict]:
    """The prompts of `seq_ids` an earlier, interrupted run with the same `run_key` finished, by seq_id. The log
    is rewritten to hold just those lines (a line cut short by the crash, from other settings or for prompts not
    asked for now is dropped)."""
    seq_ids = set(seq_ids)
    log_path = Path(log_path)
    if not log_path.is_file():
        return {}
    done = {}
    for line in log_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("run_key") == run_key and record.get("seq_id") in seq_ids:
            done[record["seq_id"]] = record
    tmp = log_path.with_name(log_path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    tmp.replace(log_path)
    return done


def evaluate(target, prompts, settings: DecodeSettings, *, methods=METHODS, proposer=None, datastore=None, stop_token_ids=(),
             log_path=None, warmup=True, progress=True, done: dict[str, dict] | None = None, run_key=None,
             loaded_target=None) -> list[dict]:
    """Run every method on every prompt (methods interleaved per prompt, so load drifts hit all alike).
    One line per prompt is appended to `log_path` as it finishes (tagged with `run_key`); prompts in `done`
    (seq_id -> record, from `finished_records`) are taken as they are, not run again."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    drafting = [m for m in methods if m in DRAFTER_METHODS]
    if drafting and proposer is None:
        raise ValueError(f"method {drafting[0]} needs a drafter")
    greedy_only = [m for m in GREEDY_ONLY if m in methods]
    if greedy_only and settings.temperature > 0:
        raise ValueError(f"method {greedy_only[0]} is greedy only: drop it from eval.methods or set eval.temperature=0 (got {settings.temperature})")
    done = done or {}
    if any(method not in done[p.seq_id]["methods"] for p in prompts if p.seq_id in done for method in methods):
        raise ValueError("finished records lack some of the methods asked for; their run_key must cover the methods")
    if warmup and any(p.seq_id not in done for p in prompts):  # first calls pay one-off costs (allocator, kernels); keep them out of the timing
        short = DecodeSettings(**{**asdict(settings), "max_new_tokens": min(8, settings.max_new_tokens)})
        for method in methods:
            run_method(method, target, prompts[0], short, proposer=proposer, datastore=datastore, stop_token_ids=stop_token_ids,
                       loaded_target=loaded_target)
    records = []
    bar = tqdm(total=len(prompts) * len(methods), desc="eval", unit="gen", disable=not progress)
    log = open(log_path, "a") if log_path else None
    try:
        for i, prompt in enumerate(prompts):
            if prompt.seq_id in done:
                records.append(done[prompt.seq_id])
                bar.update(len(methods))
                continue
            record = {"source": prompt.source, "record_id": prompt.record_id, "seq_id": prompt.seq_id, "prompt_tokens": len(prompt.input_ids), "methods": {}}
            if run_key is not None:
                record["run_key"] = run_key
            for method in methods:
                bar.set_postfix_str(f"{prompt.source}/{prompt.record_id} {method}")
                g = run_method(method, target, prompt, settings, proposer=proposer, datastore=datastore,
                               stop_token_ids=stop_token_ids, seed=settings.seed + i, loaded_target=loaded_target)
                record["methods"][method] = {
                    "tokens": g.tokens,
                    "prefill_s": g.prefill_s,
                    "decode_s": g.decode_s,
                    "acceptance_lengths": g.acceptance_lengths,
                    "verified_drafts": g.verified_drafts,
                    "draft_s": sum(g.draft_s),
                    "verify_s": sum(g.verify_s),
                    "bookkeeping_s": sum(g.bookkeeping_s),
                    "lookup_rounds": g.lookup_rounds,
                    "datastore_rounds": g.datastore_rounds,
                    "stopped": g.stopped,
                }
                bar.update()
            records.append(record)
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
    finally:
        bar.close()
        if log:
            log.close()
    return records


def _decode_throughput(records, method) -> tuple[int, float]:
    """(decode tokens, decode seconds) of `method` over `records`."""
    runs = [r["methods"][method] for r in records]
    return sum(sum(run["acceptance_lengths"]) for run in runs), sum(run["decode_s"] for run in runs)


def method_summary(records, method, *, greedy: bool, block_size: int | None = None) -> dict:
    runs = [r["methods"][method] for r in records]
    rounds = [a for run in runs for a in run["acceptance_lengths"]]
    decode_tokens, decode_s = _decode_throughput(records, method)
    summary = {
        "prompts": len(runs),
        "new_tokens": sum(len(run["tokens"]) for run in runs),
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "prefill_s": sum(run["prefill_s"] for run in runs),
        "rounds": len(rounds),
        "tau": decode_tokens / len(rounds) if rounds else None,
        "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
        "speedup": None,
        "lossless": None,
    }
    for baseline, key in (("plain", "speedup"), ("plain_as_loaded", "speedup_vs_loaded")):
        if baseline in records[0]["methods"]:
            tokens, seconds = _decode_throughput(records, baseline)
            if summary["tokens_per_s"] and tokens and seconds > 0:
                summary[key] = summary["tokens_per_s"] / (tokens / seconds)
    if "plain" in records[0]["methods"] and greedy:
        same = [r["methods"][method]["tokens"] == r["methods"]["plain"]["tokens"] for r in records]
        summary["lossless"] = all(same)
        summary["mismatched_prompts"] = [f"{r['source']}/{r['record_id']}" for r, ok in zip(records, same) if not ok]
    if method in DRAFTER_METHODS:
        counts = Counter(rounds)
        longest = max(block_size or 1, max(rounds, default=1))  # a lookup round can commit more than a block
        summary["acceptance_histogram"] = {str(k): counts.get(k, 0) for k in range(1, longest + 1)}
        n = max(len(rounds), 1)
        verified = [v for run in runs for v in run.get("verified_drafts", [])]
        summary["verified_drafts"] = sum(verified) / len(verified) if verified else None
        summary["round_ms"] = {part: 1000 * sum(run[f"{part}_s"] for run in runs) / n for part in ("draft", "verify", "bookkeeping")}
        if method in LOOKUP_METHODS:
            summary["lookup_rounds"] = sum(run.get("lookup_rounds", 0) for run in runs)
        if method == "dflash_datastore":
            summary["datastore_rounds"] = sum(run.get("datastore_rounds", 0) for run in runs)
    return summary


def summarize(records, methods, *, greedy: bool, block_size: int | None) -> dict:
    out = {}
    for method in methods:
        out[method] = method_summary(records, method, greedy=greedy, block_size=block_size)
        out[method]["by_source"] = {
            source: method_summary([r for r in records if r["source"] == source], method, greedy=greedy, block_size=block_size)
            for source in dict.fromkeys(r["source"] for r in records)
        }
    return out


def environment() -> dict:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
