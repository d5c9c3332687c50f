"""Evaluation: every method on the same prompts, methods interleaved per prompt, one record a prompt.

Decode time excludes the prefill (the prompt forward that emits the first token) for every method; speedup is
decode throughput over plain decoding's on the same prompts, which for greedy (identical outputs) is plain decode
wall time / method decode wall time (`harness.summary`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft.prompts import load_prompts
from flashdraft.target import chat_input_ids
from harness.methods import DecodeSettings, run_method
from harness.speculative import Generation

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
    thinking: bool | None = None  # the chat template's enable_thinking it was rendered with (None: not set)

    @property
    def key(self) -> str:
        """What runs.jsonl knows it by: its seq_id, and its thinking mode where one was set."""
        return prompt_key(self.seq_id, self.thinking)


def prompt_key(seq_id: str, thinking: bool | None) -> str:
    return seq_id if thinking is None else f"{seq_id}|thinking={'on' if thinking else 'off'}"


def thinking_modes(setting: str | None, chat_default: bool | None) -> list[bool | None]:
    """The enable_thinking values eval.thinking asks for (None: the model's chat default, as before the setting)."""
    return {None: [chat_default], "on": [True], "off": [False], "both": [True, False]}[setting]


def build_prompts(
    tokenizer, sources, *, split="heldout", limit=None, system_prompt=None, enable_thinking=None, modes=None
) -> list[EvalPrompt]:
    """Chat-templated prompts, `limit` per source; MT-Bench and other multi-turn sources: first turn. `modes`
    (enable_thinking values, `thinking_modes`) renders each record once per mode, the modes of a record next to
    each other so that load drifts hit them alike; without it, each record once with `enable_thinking`."""
    prompts = []
    for source in [sources] if isinstance(sources, str) else list(sources):
        records = load_prompts(source, split=None if split == "all" else split, limit=limit)
        if not records:
            raise ValueError(f"prompt source {source!r} has no {split!r} prompts")
        for r in records:
            for mode in [enable_thinking] if modes is None else modes:
                ids = chat_input_ids(tokenizer, list(r.messages), enable_thinking=mode, system_prompt=system_prompt)
                prompts.append(EvalPrompt(r.source, r.record_id, ids, r.seq_id, mode))
    return prompts


def finished_records(log_path, run_key: str, keys) -> dict[str, dict]:
    """The prompts of `keys` (`EvalPrompt.key`: seq_id and thinking mode) an earlier, interrupted run with the same
    `run_key` finished, by key. The log is rewritten to hold just those lines (a line cut short by the crash, from
    other settings or for prompts not asked for now is dropped)."""
    keys = set(keys)
    log_path = Path(log_path)
    if not log_path.is_file():
        return {}
    done = {}
    for line in log_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or record.get("run_key") != run_key:
            continue
        key = prompt_key(record.get("seq_id"), record.get("thinking"))
        if key in keys:
            done[key] = record
    tmp = log_path.with_name(log_path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    tmp.replace(log_path)
    return done


def measurement(g: Generation) -> dict:
    """What a record keeps of a generation."""
    return {
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


def evaluate(
    target,
    prompts,
    settings: DecodeSettings,
    policies: dict,
    *,
    stop_token_ids=(),
    log_path=None,
    warmup=True,
    progress=True,
    done: dict[str, dict] | None = None,
    run_key=None,
    loaded_target=None,
) -> list[dict]:
    """Run every method of `policies` (`harness.methods.build_policies`) on every prompt (methods interleaved per
    prompt, so load drifts hit all alike). One line per prompt is appended to `log_path` as it finishes (tagged
    with `run_key`); prompts in `done` (`EvalPrompt.key` -> record, from `finished_records`) are taken as they are."""
    done = done or {}
    if any(method not in done[p.key]["methods"] for p in prompts if p.key in done for method in policies):
        raise ValueError("finished records lack some of the methods asked for; their run_key must cover the methods")

    def run(method, prompt, settings, seed=0):
        return run_method(
            method,
            policies[method],
            target,
            prompt.input_ids,
            settings,
            stop_token_ids=stop_token_ids,
            seed=seed,
            loaded_target=loaded_target,
        )

    if warmup and any(p.key not in done for p in prompts):  # first calls pay one-off costs (allocator, kernels)
        short = replace(settings, max_new_tokens=min(8, settings.max_new_tokens))
        for method in policies:
            run(method, prompts[0], short)
    records = []
    bar = tqdm(total=len(prompts) * len(policies), desc="eval", unit="gen", disable=not progress)
    log = open(log_path, "a") if log_path else None
    try:
        for i, prompt in enumerate(prompts):
            record = done.get(prompt.key)
            if record is None:
                record = {
                    "source": prompt.source,
                    "record_id": prompt.record_id,
                    "seq_id": prompt.seq_id,
                    **({} if prompt.thinking is None else {"thinking": prompt.thinking}),
                    "prompt_tokens": len(prompt.input_ids),
                    "methods": {},
                }
                if run_key is not None:
                    record["run_key"] = run_key
                for method in policies:
                    bar.set_postfix_str(f"{prompt.source}/{prompt.record_id} {method}")
                    record["methods"][method] = measurement(run(method, prompt, settings, seed=settings.seed + i))
                    bar.update()
                if log:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
            else:
                bar.update(len(policies))
            records.append(record)
    finally:
        bar.close()
        if log:
            log.close()
    return records


def environment() -> dict:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
