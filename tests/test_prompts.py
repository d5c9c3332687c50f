"""Prompt sources: package-shipped sets, local files with bad input, stable ids and split."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashdraft.prompts import EmptyPromptFile, PromptSourceUnavailable, check_messages, load_prompts, split_of


def test_package_shipped_sets():
    he = load_prompts("humaneval")
    mt = load_prompts("mtbench")
    assert len(he) == 164 and len(mt) == 80
    assert all(len(r.followups) == 1 for r in mt)
    assert he[0].record_id == "HumanEval/0" and "```python" in he[0].messages[0]["content"]
    again = load_prompts("humaneval")
    assert [r.seq_id for r in he] == [r.seq_id for r in again]
    assert len({r.seq_id for r in he + mt}) == 244


def test_split_is_stable_and_disjoint():
    records = load_prompts("humaneval") + load_prompts("mtbench")
    held = load_prompts("humaneval", split="heldout") + load_prompts("mtbench", split="heldout")
    train = load_prompts("humaneval", split="train") + load_prompts("mtbench", split="train")
    assert len(held) + len(train) == len(records)
    assert not {r.seq_id for r in held} & {r.seq_id for r in train}
    assert 0.1 < len(held) / len(records) < 0.3
    assert all(split_of(r.seq_id) == r.split for r in records)
    assert len(load_prompts("humaneval", split="heldout", limit=3)) == 3


def test_jsonl_bad_input_goes_to_rejects(tmp_path):
    path = tmp_path / "chats.jsonl"
    lines = [
        json.dumps({"prompt": "Write a haiku."}).encode(),
        json.dumps(
            {
                "id": "c2",
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ],
            }
        ).encode(),
        b"{not json",
        json.dumps({"prompt": "   "}).encode(),
        json.dumps({"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}).encode(),
        b'{"prompt": "caf\xe9"}',
        json.dumps({"text": "no usable field"}).encode(),
        json.dumps([1, 2]).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    rejects = []
    records = load_prompts(str(path), rejects=rejects)
    assert [r.record_id for r in records] == ["line 1", "c2"]
    assert len(records[1].messages) == 3
    reasons = [r.reason for r in rejects]
    assert any("malformed JSON" in r for r in reasons)
    assert any("empty prompt" in r for r in reasons)
    assert any("conversation starts with an assistant turn" in r for r in reasons)
    assert any("not UTF-8" in r for r in reasons)
    assert any("no 'messages' or 'prompt'" in r for r in reasons)
    assert any("not a JSON object" in r for r in reasons)
    assert len(rejects) == 6


def test_parquet_source(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["one", "two"], "response": ["1", "2"]}), path)
    records = load_prompts(str(path))
    assert len(records) == 2 and records[0].has_response and records[0].messages[1]["content"] == "1"


def test_check_messages():
    assert check_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) is None
    assert "no user" in check_messages([{"role": "system", "content": "s"}])
    assert "system message not first (message 1)" == check_messages(
        [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}]
    )


@pytest.mark.parametrize(
    "messages,reason",
    [
        ([("assistant", "a"), ("user", "u")], "conversation starts with an assistant turn (message 0)"),
        ([("system", "s"), ("assistant", "a")], "conversation starts with an assistant turn (message 1)"),
        ([("user", "u"), ("user", "v")], "roles out of order (message 1: user after user)"),
        (
            [("user", "u"), ("assistant", "a"), ("assistant", "b")],
            "roles out of order (message 2: assistant after assistant)",
        ),
        ([("user", " \n")], "empty prompt (message 0)"),
        ([("user", "u"), ("assistant", "")], "empty response (message 1)"),
        ([("user", "u"), ("robot", "r")], "unknown role 'robot' (message 1)"),
    ],
)
def test_check_messages_says_what_is_wrong(messages, reason):
    assert check_messages([{"role": r, "content": c} for r, c in messages]) == reason


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"])
def test_an_empty_prompt_file_is_an_error_naming_it(tmp_path, content):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(EmptyPromptFile, match=f"prompt file {path} is empty"):
        load_prompts(str(path))


def test_unknown_and_unreachable_sources(tmp_path):
    with pytest.raises(ValueError, match="unknown prompt source 'nope'"):
        load_prompts("nope")
    with pytest.raises(PromptSourceUnavailable, match="gsm8k"):
        load_prompts("gsm8k")
    with pytest.raises(PromptSourceUnavailable, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_pydocs_source_is_large_and_deterministic():
    records = load_prompts("pydocs")
    assert len(records) > 2000
    assert len({r.seq_id for r in records}) == len(records)
    assert [r.seq_id for r in load_prompts("pydocs", limit=50)] == [r.seq_id for r in records[:50]]
    assert all(r.messages[0]["content"].strip() for r in records)


def test_pystubs_and_chatseeds_are_large_deterministic_and_in_their_eval_sets_form():
    stubs = load_prompts("pystubs")
    assert len(stubs) > 1000 and len({r.seq_id for r in stubs}) == len(stubs)
    assert [r.seq_id for r in load_prompts("pystubs", limit=20)] == [r.seq_id for r in stubs[:20]]
    text = stubs[0].messages[0]["content"]
    assert text.startswith("Write a solution to the following problem") and "\ndef " in text and '"""' in text
    assert len({r.record_id.split(".")[0] for r in stubs[:100]}) > 30  # a limit spreads over modules
    chats = load_prompts("chatseeds")
    assert len(chats) > 2000 and len({r.seq_id for r in chats}) == len(chats)
    assert all(len(r.followups) == 1 and r.followups[0].strip() for r in chats)
    assert len({r.record_id.split("/")[0] for r in chats[:50]}) == 8  # every MT-Bench category early on
    assert {r.split for r in chats} == {"train", "heldout"}


def test_a_per_source_limit_caps_each_source_it_names():
    from pipeline.job import load_records

    records, _ = load_records(["humaneval", "pystubs"], split="train", limit={"pystubs": 5})
    by_source = {s: sum(r.source == s for r in records) for s in ("humaneval", "pystubs")}
    assert by_source == {"humaneval": len(load_prompts("humaneval", split="train")), "pystubs": 5}
    with pytest.raises(ValueError, match="chatseeds"):
        load_records(["humaneval"], limit={"chatseeds": 5})


def test_stdlib_prompts_do_not_depend_on_what_the_process_imported_or_its_environment(monkeypatch):
    import inspect
    import logging

    from flashdraft import docprompts

    docprompts._stdlib_items.cache_clear()
    stubs, docs = docprompts.stub_prompts(), docprompts.doc_prompts()
    # what importing transformers or a profiler does to this process's stdlib, and a secret in the environment
    monkeypatch.setattr(logging.Logger, "warning_advice", lambda self, *a: None, raising=False)
    monkeypatch.setattr(inspect, "getfile", lambda obj, extra=None: "patched", raising=True)
    monkeypatch.setenv("FLASHDRAFT_PROBE_SECRET", "s3cret-value-9174")
    docprompts._stdlib_items.cache_clear()
    assert docprompts.stub_prompts() == stubs and docprompts.doc_prompts() == docs
    assert not any("warning_advice" in key for key, _ in stubs + docs)
    assert not any(
        "s3cret-value-9174" in text or "environ(" in text for _, text in stubs
    )  # os.environ defaults left out


def test_the_full_profile_takes_its_per_source_limits_from_hydra():
    from entry import compose, typed_config
    from pipeline.__main__ import records_from

    cfg = typed_config(compose(["data=full"]))  # as the entry point hands it to the stage
    records, _ = records_from(cfg)
    counts = {s: sum(r.source == s for r in records) for s in cfg.data.sources}
    assert {s: counts[s] for s in cfg.data.limit} == dict(cfg.data.limit)
    assert counts["humaneval"] == len(load_prompts("humaneval", split="train"))
    assert counts["pystubs"] == len(load_prompts("pystubs", split="train")) > 1000
