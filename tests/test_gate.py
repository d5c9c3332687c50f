"""The overfit gate (benchmarks/gate.py, issue #48): on tiny Qwen3 and Llama targets built here (a byte-level BPE
tokenizer with a ChatML template, prompts from a .jsonl file, no network), a drafter trained to near-certainty on a
few captured sequences passes in our harness and in the reference `dflash` loop with identical rounds, and the gate
fails when a known train/serve mismatch is planted: labels shifted by one, a layer id one lower at serve time."""

import json
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.spec import TRAINED_THINKING_KEY
from tests.test_speculative import one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from tests.test_thinking import QWEN3_TEMPLATE, bpe_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")  # the reference's own calls

PROMPTS = [f"Write function number {i} that adds {i} to x." for i in range(12)]


def tiny_target_dir(folder: Path, arch: str) -> str:
    """A tiny random `arch` target (8 layers: 3 features read layers 1, 3, 5) with a small BPE tokenizer; the rows
    past the tokenizer's words are spare (the mask token is one)."""
    tokenizer = bpe_tokenizer(PROMPTS, QWEN3_TEMPLATE)  # ChatML with Qwen3's generation prompt (empty think block)
    model = tiny_target(arch, vocab=320, layers=8)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    with torch.no_grad():
        # logits of a trained model's range (a random head's are nearly uniform, which a drafter reading the frozen
        # head needs many steps to sharpen); the greedy outputs are the same
        model.lm_head.weight.mul_(30.0)
        model.lm_head.weight[tokenizer.eos_token_id] = -model.lm_head.weight[tokenizer.eos_token_id].abs()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """arch -> (arch, target folder, prompts file, work folder), each built once."""
    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"gate-{arch}")
            prompts = root / "prompts.jsonl"
            prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
            made[arch] = (arch, tiny_target_dir(root / "target", arch), prompts, root)
        return made[arch]

    return get


def run(setup, name: str, plant=None, extra=()) -> dict:
    arch, target, prompts, root = setup
    overrides = [
        f"model.target={target}",
        f"model.name=tiny-{arch}",
        f"data.sources=[{prompts}]",
        f"gate.out_dir={root / name}",
        "gate.sequences=3",
        "gate.max_new_tokens=40",
        "gate.max_steps=200",
        "drafter.block_size=8",
        "drafter.num_layers=1",
        "drafter.num_features=3",
        "device=cpu",
        "train.lr=3e-3",
        "train.num_anchors=64",  # every anchor each step
        "train.loader_workers=1",
        "train.progress=false",
        *([f"gate.plant={plant}"] if plant else []),
        *extra,
    ]
    return gate.run_gate(gate.gate_config(overrides), log=lambda *a: None)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_gate_passes_in_the_harness_and_the_reference_with_identical_rounds(targets, arch):
    """Also the trainer's thinking provenance (issue #48 point 4): Qwen3's prompts are captured with thinking off,
    which the exported config records; Llama's with the template's default (data.thinking unset), which the capture
    resolves from the template (both tiny targets carry Qwen3's: thinking on unless told off) and records as on."""
    thinking = {"qwen3": "off", "llama": None}[arch]
    report = run(targets(arch), "clean", extra=[f"data.thinking={thinking}"] if thinking else [])
    assert report["passed"], report
    config = json.loads((Path(report["config"]["out_dir"]) / "drafter" / "config.json").read_text())
    assert config[TRAINED_THINKING_KEY] == {"qwen3": "off", "llama": "on"}[arch]
    assert report["train"]["tau"] >= report["train"]["stop_tau"]
    for leg in report["engines"].values():
        assert leg["tau"] >= report["need"] and leg["outputs_equal_captured"] == 3
    assert report["harness_reference_rounds_equal"]


@pytest.mark.parametrize("arch,plant", [("qwen3", "labels+1"), ("llama", "layers-1")])
def test_gate_fails_with_a_planted_mismatch_and_names_the_round(targets, arch, plant):
    report = run(targets(arch), plant, plant, extra=["gate.max_steps=120"])  # about a clean run's steps
    assert not report["passed"]
    for leg in report["engines"].values():
        assert leg["tau"] < report["need"] and not leg["passed"]
        short = leg["first_short_round"]
        assert short is not None and short["first_wrong_position"] is not None
        k = short["first_wrong_position"] - short["block_positions"][0] - 1
        assert short["drafted"][k] != short["committed_tokens"][k]
    assert report["harness_reference_rounds_equal"]  # both engines serve the same (wrong) drafter alike


def test_llamacpp_is_refused_by_name_and_a_plant_must_be_known(monkeypatch, tmp_path):
    import llamacpp

    monkeypatch.setattr(llamacpp, "tool_path", lambda name: tmp_path / "missing" / name)
    with pytest.raises(gate.GateRefused, match="llamacpp refused: no cached llama.cpp build"):
        gate.check_engines(["harness", "llamacpp"])
    with pytest.raises(gate.GateRefused, match="gate.engines"):
        gate.check_engines(["vllm"])
    with pytest.raises(gate.GateRefused, match="gate.plant"):
        gate.gate_config(["gate.plant=labels-1"])
