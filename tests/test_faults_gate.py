"""The overfit gate writes only into a folder it owns and checks the target before touching anything (issue #58,
failure 6): at b43b12f it deleted whatever `gate.out_dir` named, then failed on a missing model with a traceback."""

import json
from pathlib import Path

import pytest

from gate.__main__ import main
from gate.config import gate_config
from gate.folder import OWNED_MARK, claim_out_dir
from gate.run import run_gate
from tests.test_gate import PROMPTS, tiny_target_dir


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(target folder, prompts file): a tiny Llama the gate trains a drafter for in seconds."""
    root = tmp_path_factory.mktemp("gate-target")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return tiny_target_dir(root / "target", "llama"), prompts


def gate_args(target: str, prompts: Path, out: Path) -> list[str]:
    """A gate that runs in seconds: two short sequences, two training steps, the harness alone."""
    return [
        f"model.target={target}",
        "model.name=tiny-llama",
        f"data.sources=[{prompts}]",
        f"gate.out_dir={out}",
        "gate.sequences=2",
        "gate.max_new_tokens=16",
        "gate.max_steps=2",
        "gate.engines=[harness]",
        "data.max_length=512",
        "drafter.block_size=4",
        "drafter.num_layers=1",
        "drafter.num_features=3",
        "device=cpu",
        "train.num_anchors=16",
        "train.loader_workers=1",
        "train.progress=false",
    ]


def test_a_folder_the_gate_did_not_make_is_refused_and_left_intact(tmp_path, target, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "important.txt").write_text("keep me")
    assert main(gate_args(*target, out)) == 2
    err = capsys.readouterr().err
    assert f"gate refused: gate.out_dir {out} is not empty (important.txt) and was not made by the gate" in err
    assert [p.name for p in out.iterdir()] == ["important.txt"]
    assert (out / "important.txt").read_text() == "keep me"


def test_a_missing_model_is_refused_before_anything_is_touched(tmp_path, target, capsys):
    _, prompts = target
    for out in (tmp_path / "new", tmp_path / "mine"):
        if out.name == "mine":
            out.mkdir()
            (out / "important.txt").write_text("keep me")
        assert main(gate_args(str(tmp_path / "no-such-model"), prompts, out)) == 2
        err = capsys.readouterr().err
        assert f"gate refused: model.target={tmp_path / 'no-such-model'}: target" in err
        assert "is neither a local folder nor reachable" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["important.txt"]


def test_a_rerun_into_its_own_folder_clears_it_and_runs(tmp_path, target):
    out = tmp_path / "gate"
    first = run_gate(gate_config(gate_args(*target, out)), log=lambda *a: None)
    assert (out / "gate.json").is_file() and (out / OWNED_MARK).is_file()
    (out / "train" / "left-over.txt").write_text("from the first run")
    second = run_gate(gate_config(gate_args(*target, out)), log=lambda *a: None)
    assert not (out / "train" / "left-over.txt").exists()  # its own folder is cleared at each run
    assert second["train"]["steps"] == first["train"]["steps"] and (out / "gate.json").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is taken, and marked
    claim_out_dir(empty)
    assert [p.name for p in empty.iterdir()] == [OWNED_MARK]
