"""Thinking on and off (issue #40): a mixed capture draws each prompt's mode from its seq_id and records it per
sequence; the harness evaluates both modes and reports tau per mode. On a tiny random Qwen3 with a byte-level BPE
tokenizer and the generation-prompt part of Qwen3's chat template."""

import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from flashdraft.config import thinking_setting
from flashdraft.prompts import thinking_of
from flashdraft.spec import TRAINED_THINKING_KEY, DraftSpec
from flashdraft.store import StoreReader, read_manifest, verify_store, write_store
from flashdraft.target import (
    chat_input_ids,
    load_config,
    load_tokenizer,
    resolved_thinking,
    template_default_thinking,
)
from harness.__main__ import run
from harness.drafter import thinking_warning
from harness.evaluate import build_prompts
from pipeline.__main__ import thinking_settings
from pipeline.job import load_records
from tests.test_harness_cli import eval_settings, overrides
from tests.test_pipeline import fleet_run, write_jsonl
from tests.test_speculative import one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)

# Qwen3's template, its messages simplified to ChatML; the generation prompt as Qwen3 writes it: with thinking off,
# an empty think block the model is to answer after
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
# a template whose default is thinking off: the empty think block unless enable_thinking is set true
OFF_BY_DEFAULT_TEMPLATE = QWEN3_TEMPLATE.replace(
    "enable_thinking is defined and enable_thinking is false", "not (enable_thinking is defined and enable_thinking)"
)
CHATML_TEMPLATE = QWEN3_TEMPLATE.split("{%- if enable_thinking")[0] + "{%- endif %}"
SHARE = 0.5
PROMPTS = [f"Write a short story number {i} about a cat." for i in range(10)]


def bpe_tokenizer(texts, chat_template: str) -> PreTrainedTokenizerFast:
    """A small byte-level BPE (300 words) trained on a line of code and `texts`, with ChatML's and Qwen3's think
    specials, under `chat_template`."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["def solution(x):\n    return x + 1\n", *texts] * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template
    )


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 (10 layers: the untrained drafter reads 5 distinct ones) with a Qwen3-style template."""
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = bpe_tokenizer(PROMPTS, QWEN3_TEMPLATE)
    model = tiny_target("qwen3", vocab=320, layers=10)  # spare rows past the tokenizer: the mask token's
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_settings_name_the_modes():
    assert thinking_setting(None, "data.thinking", ("on", "off", "mixed")) is None
    assert thinking_setting(True, "data.thinking", ("on", "off", "mixed")) == "on"  # a yaml `on`
    assert thinking_setting("False", "data.thinking", ("on", "off", "mixed")) == "off"
    with pytest.raises(ValueError, match="eval.thinking"):
        thinking_setting("mixed", "eval.thinking", ("on", "off", "both"))
    assert thinking_settings(None, None, 0.5) == {"enable_thinking": None, "thinking_share": None}
    assert thinking_settings(True, "off", 0.5) == {"enable_thinking": False, "thinking_share": None}
    assert thinking_settings(None, "mixed", 0.25) == {"enable_thinking": None, "thinking_share": 0.25}


def test_mixed_capture_records_each_sequences_mode_as_drawn_from_its_seq_id(tmp_path, qwen3_dir):
    """Half the prompts with thinking on, each picked by a hash of its seq_id: the shards record the mode of every
    sequence, a thinking-off prompt ends with the empty think block and a thinking-on one holds none, the store
    verifies, and a rerun (resume) adds nothing."""
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    records, _ = load_records([str(tmp_path / "p.jsonl")], split=None)
    first = fleet_run(tmp_path / "s", qwen3_dir, records, thinking_share=SHARE, max_new_tokens=6)
    assert first.new_sequences == len(PROMPTS)
    store, tok = StoreReader(tmp_path / "s"), load_tokenizer(qwen3_dir)
    expected = [thinking_of(s, SHARE) for s in store.seq_ids]
    assert store.thinking == expected and set(expected) == {True, False}  # both modes, as the hash draws them
    by_id = {r.seq_id: r for r in records}
    for i, seq_id in enumerate(store.seq_ids):
        s, mode = store.read(i), expected[i]
        prompt = s.input_ids[~s.loss_mask].tolist()
        assert prompt == chat_input_ids(tok, list(by_id[seq_id].messages), enable_thinking=mode)
        text = tok.decode(prompt, skip_special_tokens=False)
        if mode:
            assert text.endswith("<|im_start|>assistant\n") and "<think>" not in text
        else:
            assert text.endswith(EMPTY_THINK)
    assert verify_store(tmp_path / "s", progress=False)[0] == []
    assert read_manifest(tmp_path / "s")["generation"]["thinking_share"] == SHARE
    again = fleet_run(tmp_path / "s", qwen3_dir, records, thinking_share=SHARE, max_new_tokens=6)
    assert again.new_sequences == 0 and again.sequences == len(PROMPTS)
    assert StoreReader(tmp_path / "s").thinking == expected


def test_shards_without_a_mode_read_as_unknown(tmp_path):
    """A store of a target without thinking keeps its shard attrs as before; its sequences read as None."""
    import torch

    seq = {"seq_id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "features": torch.zeros(3, 4)}
    reader = write_store(tmp_path / "s", [seq], layer_ids=[0], hidden_size=4, dtype="float32")
    assert reader.thinking == [None]
    attrs = json.loads((tmp_path / "s" / "shards" / "shard-00000" / "zarr.json").read_text())["attributes"]
    assert "thinking" not in attrs


def test_harness_reports_tau_per_mode_and_stays_lossless_in_each(qwen3_dir, tmp_path):
    """eval.thinking=both: every prompt in each mode, its records tagged; the report gives tau per mode, greedy
    DFlash output equals plain output in each, and a rerun resumes every (prompt, mode) without running it again."""
    tok = load_tokenizer(qwen3_dir)
    on, off = (build_prompts(tok, ["humaneval"], limit=1, enable_thinking=m)[0] for m in (True, False))
    assert tok.decode(off.input_ids).endswith(EMPTY_THINK) and "<think>" not in tok.decode(on.input_ids)
    over = overrides(
        qwen3_dir,
        tmp_path,
        "eval.thinking=both",
        "eval.methods=[plain,dflash]",
        "eval.block_size=4",
        "eval.limit=1",
        "eval.turns=single",
    )
    report = run(eval_settings(over))
    dflash = report["methods"]["dflash"]
    assert set(dflash["by_thinking"]) == {"on", "off"}
    for mode in ("on", "off"):
        assert dflash["by_thinking"][mode]["tau"] >= 1 and dflash["by_thinking"][mode]["lossless"] is True
        assert dflash["by_thinking"][mode]["prompts"] == 2  # one humaneval and one mtbench prompt
    lines = [json.loads(x) for x in (tmp_path / "eval" / "runs.jsonl").read_text().splitlines()]
    assert sorted(x["thinking"] for x in lines) == [False, False, True, True]
    assert "## thinking on" in (tmp_path / "eval" / "report.md").read_text()
    again = run(eval_settings(over))
    assert again["settings"]["resumed_prompts"] == 4


def test_both_modes_with_second_turns_resume_by_mode_and_turn(qwen3_dir, tmp_path):
    """eval.thinking=both with eval.turns=all: MT-Bench's second turn is asked in each mode after that mode's own
    plain answer; runs.jsonl keeps one line per (prompt, mode, turn) and a rerun resumes all of them."""
    over = overrides(
        qwen3_dir, tmp_path, "eval.thinking=both", "eval.methods=[plain,dflash]", "eval.block_size=4", "eval.limit=1"
    )
    report = run(eval_settings(over))
    dflash = report["methods"]["dflash"]
    for mode in ("on", "off"):
        assert dflash["by_thinking"][mode]["prompts"] == 3  # humaneval, MT-Bench turn 1 and turn 2
        assert dflash["by_thinking"][mode]["lossless"] is True
    lines = [json.loads(x) for x in (tmp_path / "eval" / "runs.jsonl").read_text().splitlines()]
    keys = sorted((x["source"], x["thinking"], x["turn"]) for x in lines)
    assert keys == sorted(
        [("humaneval", m, 1) for m in (False, True)] + [("mtbench", m, t) for m in (False, True) for t in (1, 2)]
    )
    assert run(eval_settings(over))["settings"]["resumed_prompts"] == 6


def test_the_chat_default_resolves_to_the_mode_the_template_renders():
    """A template's default thinking mode is read by rendering a probe with no enable_thinking and with each value:
    Qwen3's (thinking on unless told off), one that thinks only when told, one that takes no enable_thinking."""
    qwen3, off, chatml = (bpe_tokenizer(PROMPTS, t) for t in (QWEN3_TEMPLATE, OFF_BY_DEFAULT_TEMPLATE, CHATML_TEMPLATE))
    assert [template_default_thinking(t) for t in (qwen3, off, chatml)] == [True, False, None]
    assert [resolved_thinking(qwen3, m) for m in (None, True, False)] == [True, True, False]
    assert [resolved_thinking(off, m) for m in (None, True, False)] == [False, True, False]
    assert [resolved_thinking(chatml, m) for m in (None, True, False)] == [None, None, None]


def test_a_capture_in_the_chat_default_records_the_templates_mode_and_the_harness_warns_on_the_other(
    tmp_path, qwen3_dir
):
    """data.thinking unset on Qwen3's template (its default: thinking on): every sequence records thinking on (not
    None), the drafter's config.json says "on", and the harness warns when it evaluates thinking off, not when it
    evaluates the chat default (resolved: on); a drafter trained off is warned about under the chat default."""
    from trainer.drafter import trained_thinking

    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS[:3]])
    records, _ = load_records([str(tmp_path / "p.jsonl")], split=None)
    fleet_run(tmp_path / "s", qwen3_dir, records, max_new_tokens=4)  # enable_thinking None, no share: the default
    store, tok = StoreReader(tmp_path / "s"), load_tokenizer(qwen3_dir)
    assert store.thinking == [True] * 3
    prompt = store.read(0).input_ids[~store.read(0).loss_mask].tolist()
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")  # rendered as default

    # the trainer's record (trainer/train.py: trained_thinking of the training sequences' modes) in config.json
    from flashdraft.model import DFlashDrafter

    config = DraftSpec((1, 3, 5), 300, 4, 1).draft_config(load_config(qwen3_dir))
    setattr(config, TRAINED_THINKING_KEY, trained_thinking(store.thinking))
    DFlashDrafter(config).save_pretrained(tmp_path / "drafter")
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())[TRAINED_THINKING_KEY] == "on"

    def warning(drafter, *extra):
        over = overrides(
            qwen3_dir,
            tmp_path / "eval",
            f"eval.drafter={drafter}",
            "eval.methods=[dflash]",
            "eval.limit=1",
            "eval.turns=single",
            "eval.prompts=[humaneval]",
            "eval.max_new_tokens=4",
            "eval.resume=false",
            *extra,
        )
        return run(eval_settings(over))["settings"]["thinking_warning"]

    assert "evaluated with thinking off" in warning(tmp_path / "drafter", "eval.thinking=off")
    assert warning(tmp_path / "drafter") is None  # the chat default is thinking on, as trained
    off = json.loads((tmp_path / "drafter" / "config.json").read_text()) | {TRAINED_THINKING_KEY: "off"}
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(off))
    assert "evaluated with thinking on" in warning(tmp_path / "drafter")
    assert "evaluated with thinking on" in thinking_warning(SimpleNamespace(**off), [resolved_thinking(tok, None)])
