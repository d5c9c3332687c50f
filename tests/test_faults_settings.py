"""Every numeric setting checked once, where the composed config becomes typed settings (entry.ranges), naming the key
and its range: no setting reaches arithmetic (a range() step, a modulo, a reshape) unchecked, no run exits 0 having
done nothing, no sequence is captured past the target's positions, and a task that fails for a setting is not
retried (issue #58, failures 7 and 9)."""

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from entry import compose, typed_config
from flashdraft.config import Config
from tests.test_faults_writer import pipeline_cmd, run
from tests.test_pipeline import build_tiny_target, fleet_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


# (override, the message's start): each was accepted at b43b12f and failed later (or never)
REFUSED = [
    ("data.shard_size=0", "data.shard_size must be an integer >= 1, got 0"),  # range() arg 3 must not be zero
    ("data.store.chunk_tokens=0", "data.store.chunk_tokens must be an integer >= 1, got 0"),  # ZeroDivisionError
    ("data.store.shard_tokens=0", "data.store.shard_tokens must be an integer >= 1, got 0"),
    ("data.store.shard_tokens=100", "data.store.shard_tokens must be a multiple of data.store.chunk_tokens (64)"),
    ("train.num_anchors=0", "train.num_anchors must be an integer >= 1, got 0"),  # a reshape error
    ("train.grad_accum=0", "train.grad_accum must be an integer >= 1, got 0"),  # ZeroDivisionError
    ("train.stores=[]", "train.stores must be a non-empty list of the feature stores to train on, got []"),
    ("train.max_steps=-1", "train.max_steps must be an integer >= 1 or null (null: every step of train.epochs)"),
    ("train.max_steps=0", "train.max_steps must be an integer >= 1 or null"),  # trained every epoch
    ("train.token_budget=0", "train.token_budget must be an integer >= 1, got 0"),
    ("data.max_length=-1", "data.max_length must be an integer >= 2, got -1"),  # exit 0, every prompt rejected
    ("data.max_new_tokens=-1", "data.max_new_tokens must be an integer >= 1, got -1"),  # retried three times
    ("eval.max_new_tokens=0", "eval.max_new_tokens must be an integer >= 1, got 0"),
    ("eval.limit=0", "eval.limit must be an integer >= 1 or null (null: all), got 0"),
    ("data.batch_size=0", "data.batch_size must be an integer >= 1 or auto, got 0"),
    ("cluster.max_attempts=0", "cluster.max_attempts must be an integer >= 1, got 0"),
    ("train.betas=[0.9]", "train.betas must be a list of 2 numbers, each in [0, 1), got [0.9]"),
    ("gate.threshold=1.5", "gate.threshold must be a number in (0, 1], got 1.5"),
]


@pytest.mark.parametrize("override,message", REFUSED, ids=[o for o, _ in REFUSED])
def test_a_setting_out_of_its_range_is_refused_at_the_entry_naming_key_and_range(override, message):
    with pytest.raises(ValueError) as refused:
        typed_config(compose([override]))
    assert str(refused.value).startswith(message), refused.value


def numeric_fields(schema: type, prefix: str = "") -> list[str]:
    """The dotted keys of every field of `schema` (and its nested dataclasses) typed as a number or a list of
    numbers, plus the untyped fields that take a number or auto."""
    keys = []
    for f in dataclasses.fields(schema):
        hint = typing.get_type_hints(schema)[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            keys += numeric_fields(hint, key + ".")
            continue
        args = typing.get_args(hint)
        inner = [a for a in (args or (hint,)) if a is not type(None)]
        inner = [typing.get_args(a)[0] if typing.get_origin(a) is list else a for a in inner]
        if any(a in (int, float) for a in inner):
            keys.append(key)
    return keys


def outside(rule) -> str:
    """A value just outside `rule`'s range, as a command line gives it."""
    step = 1 if rule.kind == "int" else 0.5
    bad = rule.low - (0 if rule.low_open else step) if rule.low is not None else rule.high + step
    bad = int(bad) if rule.kind == "int" else bad
    return f"[{bad},{bad}]" if rule.each else str(bad)


def test_every_numeric_field_of_the_typed_configs_has_a_range():
    from entry.ranges import FIGURES, RULES
    from flashdraft.config import SourceFigures

    numeric = numeric_fields(Config) + [f"{FIGURES}.{k}" for k in numeric_fields(SourceFigures)]
    assert "train.max_steps" in numeric and "data.store.chunk_tokens" in numeric and "seed" in numeric
    assert sorted(set(numeric) - set(RULES)) == [], "numeric settings without a range in entry/ranges.py"
    untyped_numbers = {"data.batch_size", "data.prefill_tokens", "data.writer_threads", "cluster.num_actors"}
    untyped_numbers |= {"cluster.gpus_per_actor", "cluster.cpus_per_actor"}
    assert sorted(set(RULES) - set(numeric) - untyped_numbers) == [], "ranges of settings that do not exist"
    for key, rule in RULES.items():  # and the entry enforces each: a value just outside is refused by name
        override = f"{key}={outside(rule)}"
        if key.startswith(FIGURES + "."):
            figures = {"samples": 10, "prompt_tokens": 5, "response_tokens": 5, key.rsplit(".", 1)[1]: outside(rule)}
            override = "+data.figures.src={" + ", ".join(f"{k}: {v}" for k, v in figures.items()) + ", source: s}"
        with pytest.raises(ValueError, match=rf"^{key.replace('*', 'src')} must be "):
            typed_config(compose([override]))
    for profile in ("quick", "full", "broad"):  # every shipped profile is within its ranges
        typed_config(compose([f"profile={profile}"]))
    for group in ("data=nemotron", "data=codealpaca", "train=paper", "eval=paper", "cluster=slurm", "model=qwen3-8b"):
        typed_config(compose([group]))


def test_a_bad_setting_stops_the_capture_before_anything_is_written(tmp_path, target):
    """A range the entry checks (each one's message: the test above) and one it checks against the target's
    positions, through the command."""
    store = tmp_path / "store"
    for override, message in [
        ("data.shard_size=0", "error: data.shard_size must be an integer >= 1, got 0 (prompts per fleet task"),
        ("data.max_length=40000", "error: data.max_length must be at most the target's 4096 positions"),
    ]:
        proc = run([*pipeline_cmd(target, store, 2, tmp_path / "run"), override])
        assert proc.returncode == 1, (override, proc.stdout[-2000:], proc.stderr[-2000:])
        assert message in proc.stderr, (override, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr
        assert not store.exists(), override


def test_a_task_failing_for_a_setting_is_not_retried(tmp_path, target):
    """A deterministic error (ValueError) fails its shard at the first attempt: another worker would fail alike."""
    from flashdraft.prompts import load_prompts

    summary = fleet_run(tmp_path / "s", target, load_prompts("humaneval", limit=2), max_new_tokens=-1, max_attempts=3)
    assert summary.retried == [], summary.lines()
    assert [f["attempts"] for f in summary.failed] == [1]
    assert "max_new_tokens must be >= 1" in summary.failed[0]["error"]


def test_a_trainer_given_max_steps_minus_one_refuses_and_leaves_the_drafter(tmp_path):
    """At b43b12f: "done: 0 steps", an untrained drafter exported over the existing one, exit 0."""
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"trained": true}')
    cmd = [sys.executable, "-m", "trainer", f"run_dir={tmp_path}", f"drafter_dir={drafter}", "train.max_steps=-1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "train.max_steps must be an integer >= 1 or null (null: every step of train.epochs), got -1" in (
        proc.stdout + proc.stderr
    )
    assert not (tmp_path / "train").exists()  # nothing trained, no checkpoint (Hydra's own log folder aside)
    assert (drafter / "config.json").read_text() == '{"trained": true}'
