"""Evaluation: every method on the same prompts, methods interleaved per prompt, one record a prompt.

Decode time excludes the prefill (the prompt forward that emits the first token) for every method; speedup is
decode throughput over plain decoding's on the same prompts, which for greedy (identical outputs) is plain decode
wall time / method decode wall time (`harness.summary`).

Multi-turn records (MT-Bench's second questions: `PromptRecord.followups`) are evaluated turn by turn with
eval.turns=all: turn 1 as any prompt; then the target's own answer to it, plain decoding's output (the greedy output
every lossless method equals; with sampling, plain's draw, so every method sees one context), joins the conversation
as the assistant message, the next user turn follows, the chat template renders it, and every method decodes the
next turn from that context. One record a prompt turn, tagged with its `turn` (from 1).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft.prompts import load_prompts
from flashdraft.target import chat_input_ids
from harness.methods import PLAIN, DecodeSettings, run_method
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
    turn: int = 1  # which user turn of the conversation this prompt asks (from 1)
    messages: tuple = ()  # the conversation `input_ids` renders (for the next turn's)
    followups: tuple = ()  # the user turns still to come (eval.turns=single: none)
    chat: dict = field(default_factory=dict)  # chat_input_ids options the prompt was rendered with

    @property
    def thinking(self) -> bool | None:
        """The chat template's enable_thinking the prompt was rendered with (None: not set)."""
        return self.chat.get("enable_thinking")

    @property
    def key(self) -> str:
        """What runs.jsonl knows the conversation by: its seq_id, and its thinking mode where one was set."""
        return prompt_key(self.seq_id, self.thinking)


TURNS = ("all", "single")
TURN_SEED_STRIDE = 100_003  # a later turn's sampling seed: the first turn's plus this per turn, apart from others'


def prompt_key(seq_id: str, thinking: bool | None) -> str:
    return seq_id if thinking is None else f"{seq_id}|thinking={'on' if thinking else 'off'}"


def thinking_modes(setting: str | None, chat_default: bool | None) -> list[bool | None]:
    """The enable_thinking values eval.thinking asks for (None: the model's chat default)."""
    return {None: [chat_default], "on": [True], "off": [False], "both": [True, False]}[setting]


def build_prompts(
    tokenizer,
    sources,
    *,
    split="heldout",
    limit=None,
    system_prompt=None,
    enable_thinking=None,
    turns="all",
    modes=None,
) -> list[EvalPrompt]:
    """Chat-templated first-turn prompts, `limit` per source. Multi-turn sources (MT-Bench) keep their later user
    turns as `followups` with turns=all, for `evaluate` to ask after each answer; turns=single drops them. `modes`
    (enable_thinking values, `thinking_modes`) renders each record once per mode, the modes of a record next to
    each other so that load drifts hit them alike; without it, each record once with `enable_thinking`."""
    if turns not in TURNS:
        raise ValueError(f"eval.turns must be one of {TURNS}, not {turns!r}")
    prompts = []
    chat = {"enable_thinking": enable_thinking, "system_prompt": system_prompt}
    for source in [sources] if isinstance(sources, str) else list(sources):
        records = load_prompts(source, split=None if split == "all" else split, limit=limit)
        if not records:
            raise ValueError(f"prompt source {source!r} has no {split!r} prompts")
        for r in records:
            followups = tuple(r.followups) if turns == "all" else ()
            for mode in [enable_thinking] if modes is None else modes:
                chat = {"enable_thinking": mode, "system_prompt": system_prompt}
                ids = chat_input_ids(tokenizer, list(r.messages), **chat)
                prompts.append(EvalPrompt(r.source, r.record_id, ids, r.seq_id, 1, tuple(r.messages), followups, chat))
    return prompts


def next_turn(tokenizer, prompt: EvalPrompt, answer: list[int], stop_token_ids=()) -> EvalPrompt:
    """The prompt of the turn after `prompt`: its conversation, the target's `answer` to it as the assistant message
    (a final stop token dropped: the template closes the turn; an answer cut at max_new_tokens goes in as written),
    then the next user turn, rendered by the chat template as the first turn was. Where the rendering differs from
    the tokens decoded so far (a template that strips earlier thinking), it wins: a served chat feeds that."""
    if not prompt.followups:
        raise ValueError(f"{prompt.source}/{prompt.record_id} has no turn after turn {prompt.turn}")
    if answer and answer[-1] in set(stop_token_ids):
        answer = answer[:-1]
    text = tokenizer.decode(answer, skip_special_tokens=False)
    messages = (
        *prompt.messages,
        {"role": "assistant", "content": text},
        {"role": "user", "content": prompt.followups[0]},
    )
    ids = chat_input_ids(tokenizer, list(messages), **prompt.chat)
    return replace(prompt, input_ids=ids, turn=prompt.turn + 1, messages=messages, followups=prompt.followups[1:])


def finished_records(log_path, run_key: str, turns: dict[str, int]) -> dict[tuple[str, int], dict]:
    """The prompt turns an earlier, interrupted run with the same `run_key` finished, by (`EvalPrompt.key`, turn),
    of the prompts in `turns` (key -> turns asked for; a line without a turn is a first turn). The log is rewritten
    to hold just those lines (a line cut short by the crash, from other settings or for prompt turns not asked for
    now is dropped)."""
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
        key, turn = prompt_key(record.get("seq_id"), record.get("thinking")), record.get("turn", 1)
        if isinstance(record.get("seq_id"), str) and isinstance(turn, int) and 1 <= turn <= turns.get(key, 0):
            done[key, turn] = record
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
    done: dict[tuple[str, int], dict] | None = None,
    run_key=None,
    loaded_target=None,
    follow=None,
) -> list[dict]:
    """Run every method of `policies` (`harness.methods.build_policies`) on every prompt turn (methods interleaved
    per turn, so load drifts hit all alike). One line per prompt turn is appended to `log_path` as it finishes
    (tagged with `run_key`); turns in `done` ((`EvalPrompt.key`, turn) -> record, from `finished_records`) are taken
    as they are. `follow(prompt, answer)` (`next_turn` with the tokenizer) gives a prompt's next turn from plain
    decoding's answer (the first method's without plain); without it, or a prompt without followups, one turn is
    run."""
    done = done or {}
    if any(method not in record["methods"] for record in done.values() for method in policies):
        raise ValueError("finished records lack some of the methods asked for; their run_key must cover the methods")
    history = PLAIN if PLAIN in policies else next(iter(policies))  # whose answer the next turn continues

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

    turns = [1 + (len(p.followups) if follow else 0) for p in prompts]
    if warmup and len(done) < sum(turns):  # first calls pay one-off costs (allocator, kernels)
        short = replace(settings, max_new_tokens=min(8, settings.max_new_tokens))
        for method in policies:
            run(method, prompts[0], short)
    records = []
    bar = tqdm(total=sum(turns) * len(policies), desc="eval", unit="gen", disable=not progress)
    log = open(log_path, "a") if log_path else None
    try:
        for i, prompt in enumerate(prompts):
            while True:
                record = done.get((prompt.key, prompt.turn))
                if record is None:
                    seed = settings.seed + i + TURN_SEED_STRIDE * (prompt.turn - 1)
                    record = new_record(prompt, run_key)
                    for method in policies:
                        bar.set_postfix_str(f"{prompt.source}/{prompt.record_id} turn {prompt.turn} {method}")
                        record["methods"][method] = measurement(run(method, prompt, settings, seed=seed))
                        bar.update()
                    if log:
                        log.write(json.dumps(record) + "\n")
                        log.flush()
                else:
                    bar.update(len(policies))
                records.append(record)
                if not (follow and prompt.followups):
                    break
                prompt = follow(prompt, record["methods"][history]["tokens"])
    finally:
        bar.close()
        if log:
            log.close()
    return records


def new_record(prompt: EvalPrompt, run_key=None) -> dict:
    """A prompt turn's record, before its methods' measurements."""
    record = {
        "source": prompt.source,
        "record_id": prompt.record_id,
        "seq_id": prompt.seq_id,
        "turn": prompt.turn,
        **({} if prompt.thinking is None else {"thinking": prompt.thinking}),
        "prompt_tokens": len(prompt.input_ids),
        "methods": {},
    }
    if run_key is not None:
        record["run_key"] = run_key
    return record


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
