"""Multi-turn evaluation (eval.turns=all): MT-Bench's second questions are measured after the target's own plain
answer to the first, every method on the same context, one record a prompt turn, tau per turn and per prompt set.
The tiny target and its tokenizer are test_harness_cli's."""

import json

import pytest
from transformers import PreTrainedTokenizerFast

import harness.evaluate
from flashdraft.target import chat_input_ids
from harness.__main__ import run
from harness.evaluate import EvalPrompt, finished_records, next_turn
from tests.test_harness_cli import compose_config, eval_settings, overrides, target_dir  # noqa: F401 (target_dir: a fixture)
from tests.test_speculative import one_thread  # noqa: F401 (an autouse fixture)


@pytest.fixture
def calls(monkeypatch):
    """Every decode the harness runs: (method, prompt ids, generated tokens), warmups left out (eval.warmup=false)."""
    seen = []
    run_method = harness.evaluate.run_method

    def recording(method, policy, target, input_ids, settings, **kw):
        generation = run_method(method, policy, target, input_ids, settings, **kw)
        seen.append((method, list(input_ids), list(generation.tokens)))
        return generation

    monkeypatch.setattr(harness.evaluate, "run_method", recording)
    return seen


def mtbench_eval(target_dir, tmp_path, *extra):  # noqa: F811 (target_dir: the fixture's value)
    over = ["eval.prompts=[mtbench]", "eval.methods=[plain,dflash]", "eval.block_size=4", "eval.warmup=false"]
    return run(eval_settings(overrides(target_dir, tmp_path, *over, *extra)))


def expected_second_turn(tokenizer, first: list[int], answer: list[int], prompt: dict) -> list[int]:
    """The turn-2 prompt built by hand: the conversation of turn 1, plain's answer (its stop token dropped), the
    record's second question."""
    from flashdraft.prompts import load_prompts

    record = next(r for r in load_prompts("mtbench", split="heldout") if r.seq_id == prompt["seq_id"])
    assert chat_input_ids(tokenizer, list(record.messages)) == first
    answer = answer[:-1] if answer and answer[-1] == tokenizer.eos_token_id else answer
    messages = [
        *record.messages,
        {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=False)},
        {"role": "user", "content": record.followups[0]},
    ]
    return chat_input_ids(tokenizer, messages)


def test_second_turns_continue_plain_answers_and_stay_lossless(target_dir, tmp_path, calls, capsys):  # noqa: F811
    report = mtbench_eval(target_dir, tmp_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    records = [json.loads(line) for line in (tmp_path / "eval" / "runs.jsonl").read_text().splitlines()]
    assert [r["turn"] for r in records] == [1, 2, 1, 2]  # two prompts, each run on both turns
    assert records[0]["seq_id"] == records[1]["seq_id"] != records[2]["seq_id"] == records[3]["seq_id"]
    assert [c[0] for c in calls] == ["plain", "dflash"] * 4  # every method on every turn
    for k, record in enumerate(records):
        (_, plain_ids, plain), (_, dflash_ids, dflash) = calls[2 * k : 2 * k + 2]
        assert dflash_ids == plain_ids and len(plain_ids) == record["prompt_tokens"]  # one context for both
        assert dflash == plain == record["methods"]["plain"]["tokens"]  # lossless on both turns, token for token
    for first, second in ((0, 1), (2, 3)):
        (_, first_ids, answer), (_, second_ids, _) = calls[2 * first], calls[2 * second]
        assert second_ids == expected_second_turn(tokenizer, first_ids, answer, records[first])
        said = tokenizer.decode(answer[:-1] if answer[-1] == tokenizer.eos_token_id else answer)
        assert said.strip() and said in tokenizer.decode(second_ids)  # the turn-2 prompt holds plain's turn-1 answer
        assert second_ids[: len(first_ids)] == first_ids  # and the whole first turn before it
    for name in ("plain", "dflash"):
        m = report["methods"][name]
        assert m["lossless"] is True and m["by_turn"].keys() == {"1", "2"} and m["by_source"].keys() == {"mtbench"}
        assert m["prompts"] == 4 and [t["prompts"] for t in m["by_turn"].values()] == [2, 2]
        for key in ("rounds", "decode_tokens", "new_tokens"):  # the turns add up to the whole
            assert sum(t[key] for t in m["by_turn"].values()) == m[key] == m["by_source"]["mtbench"][key]
        assert m["tau"] == pytest.approx(m["decode_tokens"] / m["rounds"])
        assert [p["turn"] for p in report["prompts"]] == [1, 2, 1, 2]
    md = (tmp_path / "eval" / "report.md").read_text()
    printed = capsys.readouterr().out
    assert "turns all" in md and "## tau per prompt set and turn" in md
    assert "| method | all | mtbench | turn 1 | turn 2 |" in md
    for name in ("plain", "dflash"):  # tau (rounds): overall, per source, per turn; in report.md and printed
        m = report["methods"][name]
        cells = [m, m["by_source"]["mtbench"], m["by_turn"]["1"], m["by_turn"]["2"]]
        row = f"| {name} | " + " | ".join(f"{c['tau']:.2f} ({c['rounds']})" for c in cells) + " |"
        assert row in md and row in printed


def test_sampled_second_turns_share_plain_draw(target_dir, tmp_path, calls):  # noqa: F811
    """With sampling the methods' answers differ; the second turn continues plain's for every method."""
    mtbench_eval(target_dir, tmp_path, "eval.limit=1", "eval.temperature=0.8", "eval.top_k=20")
    (_, first_ids, plain), (_, _, dflash), (_, second_plain, _), (_, second_dflash, _) = calls
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    record = json.loads((tmp_path / "eval" / "runs.jsonl").read_text().splitlines()[0])
    assert second_plain == second_dflash == expected_second_turn(tokenizer, first_ids, plain, record)
    assert dflash != plain  # else the test could not tell whose answer was taken


def test_single_turns_then_all_resume_the_first_turns(target_dir, tmp_path, calls, capsys):  # noqa: F811
    """eval.turns=single measures first turns only; a later turns=all run (same settings otherwise) takes them as
    measured, keyed by (seq_id, turn), and runs the second turns from their plain answers."""
    single = mtbench_eval(target_dir, tmp_path, "eval.turns=single")
    log = tmp_path / "eval" / "runs.jsonl"
    assert [json.loads(line)["turn"] for line in log.read_text().splitlines()] == [1, 1]
    assert single["methods"]["dflash"]["by_turn"].keys() == {"1"}
    assert "turns single" in (log.parent / "report.md").read_text()
    first_calls = list(calls)
    calls.clear()
    both = mtbench_eval(target_dir, tmp_path)
    assert both["settings"]["resumed_prompts"] == 2 and "resuming: 2 of 4 prompt turns" in capsys.readouterr().out
    assert [json.loads(line)["turn"] for line in log.read_text().splitlines()] == [1, 1, 2, 2]
    assert [c[0] for c in calls] == ["plain", "dflash"] * 2  # the second turns only
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0][1] == expected_second_turn(tokenizer, first_calls[0][1], first_calls[0][2], records[0])
    assert both["methods"]["dflash"]["lossless"] is True and both["methods"]["dflash"]["prompts"] == 4


def test_finished_records_are_keyed_by_turn(tmp_path):
    log = tmp_path / "runs.jsonl"
    lines = [
        {"run_key": "k", "seq_id": "a", "methods": {}},  # from before turns: a first turn
        {"run_key": "k", "seq_id": "a", "turn": 2, "methods": {}},
        {"run_key": "k", "seq_id": "b", "turn": 2, "methods": {}},  # b asked for one turn now
        {"run_key": "other", "seq_id": "a", "turn": 3, "methods": {}},
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert finished_records(log, "k", {"a": 2, "b": 1}).keys() == {("a", 1), ("a", 2)}
    assert len(log.read_text().splitlines()) == 2


def test_next_turn_drops_the_stop_token_and_refuses_a_last_turn(target_dir):  # noqa: F811
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    chat = {"enable_thinking": None, "system_prompt": "Be brief."}
    messages = ({"role": "user", "content": "Write a story."},)
    first = EvalPrompt("s", "r", chat_input_ids(tokenizer, list(messages), **chat), "q", 1, messages, ("More.",), chat)
    answer = tokenizer("def solution(x):")["input_ids"]
    second = next_turn(tokenizer, first, [*answer, tokenizer.eos_token_id], stop_token_ids=[tokenizer.eos_token_id])
    text = tokenizer.decode(second.input_ids)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWrite a story.<|im_end|>\n"
        "<|im_start|>assistant\ndef solution(x):<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert second.turn == 2 and second.followups == () and second.seq_id == "q"
    with pytest.raises(ValueError, match="no turn after turn 2"):
        next_turn(tokenizer, second, answer)


def test_every_turn_by_default_and_first_turns_in_the_quick_profile():
    """The quick profile keeps first turns, as its published figures were made (like data.turns there)."""
    assert compose_config([]).eval.turns == "all" and compose_config(["eval=full"]).eval.turns == "all"
    assert compose_config(["profile=quick"]).eval.turns == "single"
    assert compose_config(["profile=full"]).eval.turns == "all"
