"""Faults a user meets with prompts: the same prompt twice in a file, the same file under another path or name, a
local file captured in part, and a summary that must account for every record read. Through `python -m pipeline`'s
own capture and verify commands, with a tiny target and no network."""

import hashlib
import json
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from entry import compose, typed_config
from flashdraft.prompts import load_prompts
from flashdraft.store import StoreReader, read_rejects
from pipeline.__main__ import capture_command, verify_command
from pipeline.job import load_records
from tests.test_pipeline import LAYERS, build_tiny_target, write_jsonl

TWELVE = [f"Name {n} animals that live in {place}." for n, place in enumerate(["the sea", "a desert", "a forest"], 2)]
TWELVE += [
    f"Write a {kind} about {thing}." for kind in ("haiku", "limerick", "riddle") for thing in ("rain", "salt", "clocks")
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def capture(target, prompts, store, capsys, *overrides) -> tuple[int, str]:
    """`python -m pipeline data=local data.path=PROMPTS` into `store` with the tiny target, in this process: its
    exit code and what it printed."""
    cfg = typed_config(
        compose(
            [
                "data=local",
                f"data.path={prompts}",
                f"model.target={target}",
                f"drafter.layer_ids=[{','.join(map(str, LAYERS))}]",
                f"features_dir={store}",
                "cluster.num_actors=0",
                "data.max_new_tokens=6",
                "data.batch_size=4",
                "data.shard_size=4",
                *overrides,
            ]
        )
    )
    capsys.readouterr()
    rc = capture_command(cfg)
    return rc, capsys.readouterr().out


def accounts(out: str) -> dict[str, int]:
    """The summary's "this run: N records read = a captured + b ..." line as {"read": N, "captured": a, ...}, after
    checking that its parts add up to what was read."""
    line = next(x for x in out.splitlines() if x.strip().startswith("this run:"))
    read, parts = re.fullmatch(r"\s*this run: (\d+) records read = (.*)", line).groups()
    found = {what: int(n) for n, what in (re.fullmatch(r"(\d+) (.+)", p).groups() for p in parts.split(" + "))}
    assert sum(found.values()) == int(read), line
    return {"read": int(read), **found}


def test_the_same_prompt_on_three_lines_is_stored_once_and_the_others_rejected_as_duplicates(tmp_path, target, capsys):
    src = tmp_path / "prompts.jsonl"
    write_jsonl(
        src,
        [
            {"prompt": "Tell me a joke."},
            {"prompt": "Tell me a joke.\r\n"},  # the same once the ends are stripped and newlines normalised
            {"messages": [{"role": "user", "content": "  Tell me a joke."}]},
            {"prompt": "Tell me  a joke."},  # whitespace inside is the prompt's own: another prompt
        ],
    )
    rejects = []
    records = load_prompts(str(src), rejects=rejects)
    assert [r.record_id for r in records] == ["line 1", "line 4"]
    first = records[0].seq_id
    assert [(r.record_id, r.reason) for r in rejects] == [
        (line, f"duplicate of {first} (line 1 of {src})") for line in ("line 2", "line 3")
    ]
    rc, out = capture(target, src, tmp_path / "s", capsys)
    assert rc == 0 and len(StoreReader(tmp_path / "s")) == 2
    dupes = [r for r in read_rejects(tmp_path / "s") if r["reason"].startswith("duplicate of")]
    assert [(r["source"], r["record_id"]) for r in dupes] == [(str(src), "line 2"), (str(src), "line 3")]
    assert all(r["reason"].startswith(f"duplicate of {first}") for r in dupes)
    assert accounts(out) == {**accounts(out), "read": 4, "captured": 2, "duplicates": 2}


def test_the_same_file_by_relative_and_absolute_path_or_copied_captures_nothing_new(
    tmp_path, target, capsys, monkeypatch
):
    work = tmp_path / "work"
    work.mkdir()
    write_jsonl(work / "prompts.jsonl", [{"prompt": p} for p in TWELVE[:6]])
    monkeypatch.chdir(work)
    store = tmp_path / "s"
    rc, out = capture(target, "prompts.jsonl", store, capsys)
    assert rc == 0 and accounts(out)["captured"] == 6
    stored = sorted(StoreReader(store).seq_ids)

    copy = tmp_path / "elsewhere" / "renamed.jsonl"
    copy.parent.mkdir()
    shutil.copy(work / "prompts.jsonl", copy)
    as_parquet = tmp_path / "elsewhere" / "prompts.parquet"  # the same records in the other file format
    pq.write_table(pa.table({"prompt": TWELVE[:6], "id": [f"p{i}" for i in range(6)]}), as_parquet)
    for again in (work / "prompts.jsonl", "./prompts.jsonl", copy, as_parquet):
        rc, out = capture(target, again, store, capsys)
        assert rc == 0 and "(0 new)" in out, out
        assert accounts(out) == {**accounts(out), "read": 6, "captured": 0, "already in the store": 6}
    assert sorted(StoreReader(store).seq_ids) == stored
    assert verify_command([str(store)]) == 0 and "OK" in capsys.readouterr().out


def test_a_local_file_is_captured_whole_and_a_split_asked_for_is_counted(tmp_path, target, capsys):
    src = tmp_path / "twelve.jsonl"
    write_jsonl(src, [{"prompt": p} for p in TWELVE])
    rc, out = capture(target, src, tmp_path / "whole", capsys)
    assert rc == 0 and len(StoreReader(tmp_path / "whole")) == 12
    assert accounts(out) == {**accounts(out), "read": 12, "captured": 12}

    rc, out = capture(target, src, tmp_path / "part", capsys, "data.split=train")
    part = accounts(out)
    held = sum(r.split == "heldout" for r in load_prompts(str(src)))
    assert held > 0 and part["outside the split"] == held and part["captured"] == 12 - held
    assert f"outside the split: {held} of the heldout split, not captured" in out
    rc, out = capture(target, src, tmp_path / "part", capsys)  # then the whole file: only the held-out ones are new
    assert accounts(out) == {**accounts(out), "read": 12, "captured": held, "already in the store": 12 - held}
    assert len(StoreReader(tmp_path / "part")) == 12


def test_rejects_duplicates_and_captures_add_up_to_the_records_read(tmp_path, target, capsys):
    src = tmp_path / "mixed.jsonl"
    write_jsonl(
        src,
        [
            {"prompt": TWELVE[0]},
            b"{not json",
            {"prompt": TWELVE[0]},
            {"prompt": "   "},
            {"prompt": "word " * 400},  # too long for data.max_prompt_tokens below: rejected in the capture
            {"prompt": TWELVE[1]},
        ],
    )
    rc, out = capture(target, src, tmp_path / "s", capsys, "data.max_prompt_tokens=200")
    got = accounts(out)
    assert got == {**got, "read": 6, "captured": 2, "duplicates": 1, "rejected": 3}
    assert "rejected: " in out and "prompt too long" in out and "malformed JSON" in out


def test_a_file_id_does_not_depend_on_path_line_or_id_column_and_built_in_ids_are_unchanged(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(a, [{"prompt": "x"}, {"prompt": "Sort a list.", "id": "first"}])
    write_jsonl(b, [{"id": "other", "messages": [{"role": "user", "content": "Sort a list.\n"}]}])
    (one,), (two,) = load_prompts(str(a))[1:], load_prompts(str(b))
    assert one.seq_id == two.seq_id and one.split == two.split and one.record_id == "first"
    # the seq_ids of the built-in sources as they were before ids by content: every store and eval set split by them
    for source, digest in (("humaneval", "e0cbf32622596fae"), ("mtbench", "fa96f26c3face766")):
        ids = " ".join(r.seq_id for r in load_prompts(source))
        assert hashlib.sha256(ids.encode()).hexdigest()[:16] == digest, source


def test_a_conversation_repeated_across_sources_is_kept_once(tmp_path):
    humaneval = load_prompts("humaneval", limit=1)[0]
    src = tmp_path / "mine.jsonl"
    write_jsonl(src, [{"messages": list(humaneval.messages)}, {"prompt": "Something new."}])
    counts = {}
    records, rejects = load_records(["humaneval", str(src)], split=None, counts=counts)
    assert [r.source for r in records].count(str(src)) == 1
    assert [(r["record_id"], r["reason"]) for r in rejects] == [
        ("line 1", f"duplicate of {humaneval.seq_id} (HumanEval/0 of humaneval)")
    ]
    assert counts == {"read": 164 + 2, "outside split": 0}
    assert json.dumps(rejects)  # rejects.jsonl takes them as they are
