"""The overfit gate (gate/, issue #48): on tiny Qwen3 and Llama targets built here (a byte-level BPE
tokenizer with a ChatML template, prompts from a .jsonl file, no network), a drafter trained to near-certainty on a
few captured sequences passes in our harness and in the reference `dflash` loop with identical rounds, and the gate
fails when a known train/serve mismatch is planted: labels shifted by one, a layer id one lower at serve time."""

import json
from pathlib import Path

import pytest
import torch

from flashdraft.spec import TRAINED_THINKING_KEY
from gate.config import GateRefused, check_engines, gate_config
from gate.engines import llamacpp_leg
from gate.leg import Leg
from gate.parity import rounds_against_harness
from gate.run import run_gate
from gate.verdict import first_short_round
from tests.test_speculative import one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from tests.test_thinking import QWEN3_TEMPLATE, bpe_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")  # the reference's own calls

PROMPTS = [f"Write function number {i} that adds {i} to x." for i in range(12)]


def tiny_target_dir(folder: Path, arch: str, tokenizer=None) -> str:
    """A tiny random `arch` target (8 layers: 3 features read layers 1, 3, 5) with a small BPE tokenizer (or
    `tokenizer`); the rows past the tokenizer's words are spare (the mask token is one)."""
    if tokenizer is None:
        tokenizer = bpe_tokenizer(PROMPTS, QWEN3_TEMPLATE)  # ChatML with Qwen3's generation prompt (empty think block)
    model = tiny_target(arch, vocab=max(320, len(tokenizer)), layers=8)
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
        "data.max_length=512",  # the tiny targets' positions (data.max_length may not pass them)
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
    return run_gate(gate_config(overrides), log=lambda *a: None)


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


def test_llamacpps_round_log_makes_a_leg_that_the_verdict_and_the_parity_read():
    """llama.cpp's rounds (`llamacpp.spec_rounds`) as a Leg: cut at a stop token and the token budget; its first round
    anchors on the prompt's last token, so a short round's block starts one position earlier than the harness's;
    rounds set against the harness's by the output position of their first committed token."""
    out = list(range(100, 112))
    log = [  # round 1 commits the first output token only, then 4 a round; the budget (10) cuts the fourth
        {"drafts": [7, 7, 7], "committed": out[:1]},
        {"drafts": out[1:4], "committed": out[1:5]},
        {"drafts": out[5:8], "committed": out[5:9]},
        {"drafts": out[9:12], "committed": [*out[9:12], 112]},
    ]
    leg = llamacpp_leg([log], max_new_tokens=10, stop=[])
    assert leg.rounds == [[1, 4, 4, 1]] and leg.outputs == [out[:10]] and leg.first_anchor == -1
    assert leg.drafts[0][0] == [7, 7, 7] and leg.tau == 2.5
    assert llamacpp_leg([log], max_new_tokens=10, stop=[101]).rounds == [[1, 1]]  # up to the stop token
    prompt = [1, 2, 3, 4, 5]
    short = first_short_round(leg, [prompt], block_size=4, need=3.6)
    assert short["round"] == 0 and short["block_positions"] == [4, 7]  # anchored on the prompt's last token
    assert short["committed_tokens"] == out[:3] and short["first_wrong_position"] == 5
    harness = Leg("harness", rounds=[[4, 3, 2]], drafts=[[out[1:4], out[5:8], out[8:11]]], outputs=[out[:10]])
    parity = rounds_against_harness(harness, leg)
    # harness rounds start at output positions 1, 5, 8; llama.cpp's at 0, 1, 5, 9: aligned at 1 (4 and 4), 5 (3, 4)
    assert (parity["aligned"], parity["equal"], parity["equal_drafts"]) == (2, 1, 2)
    assert parity["unequal"] == [
        {
            "sequence": 0,
            "output_position": 5,
            "harness_round": 1,
            "llamacpp_round": 2,
            "harness_committed": 3,
            "llamacpp_committed": 4,
            "harness_drafts": out[5:8],
            "llamacpp_drafts": out[5:8],
        }
    ]
    # anchored: llama.cpp's prompt held the first output token, its rounds start at position 1 as the harness's do
    anchored = Leg("llamacpp", rounds=[[4, 3, 2]], drafts=[[out[1:4], out[5:8], [0, 0, 0]]], outputs=[out[:10]])
    parity = rounds_against_harness(harness, anchored, llama_first=1)
    assert (parity["aligned"], parity["equal"], parity["equal_drafts"]) == (3, 3, 2)
    assert [(d["output_position"], d["llamacpp_drafts"]) for d in parity["unequal"]] == [(8, [0, 0, 0])]


def test_llamacpp_is_refused_without_a_build_and_a_plant_must_be_known(monkeypatch, tmp_path):
    from harness import llamacpp

    monkeypatch.setattr(llamacpp, "tool_path", lambda name: tmp_path / "missing" / name)
    with pytest.raises(GateRefused, match="llamacpp refused: no cached llama.cpp build"):
        check_engines(["harness", "llamacpp"])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-speculative-simple").touch()
    monkeypatch.setattr(llamacpp, "tool_path", lambda name: tmp_path / "bin" / name)
    assert check_engines(["harness", "llamacpp"]) == ["harness", "llamacpp"]  # built: its leg runs
    with pytest.raises(GateRefused, match="gate.engines"):
        check_engines(["vllm"])
    with pytest.raises(GateRefused, match="gate.plant"):
        gate_config(["gate.plant=labels-1"])


@pytest.mark.slow
def test_gate_passes_in_llamacpp_and_its_rounds_are_set_against_the_harness(tmp_path):
    """The llama.cpp leg where a build is cached (`make llamacpp`): a tiny random Llama with SmolLM2's tokenizer (one
    llama.cpp's converter knows; the test targets' own BPE it does not), its drafter converted to GGUF and served by
    `llama-speculative-simple --spec-type draft-dflash`; llama.cpp passes with the harness's outputs, and its rounds
    are set against the harness's."""
    from transformers import AutoTokenizer

    from flashdraft.target import resolve_target
    from harness import llamacpp

    tool = llamacpp.tool_path("llama-speculative-simple")
    if not tool.is_file():
        pytest.skip(f"no cached llama.cpp build ({tool} is missing): `make llamacpp` builds it")
    try:
        smol = resolve_target("smollm2-135m")
    except Exception as e:  # the embedded default's package or its cached folder
        pytest.skip(f"the embedded default target's tokenizer is not available here: {e}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    target = tiny_target_dir(tmp_path / "target", "llama", AutoTokenizer.from_pretrained(smol))
    report = run(("llama", target, prompts, tmp_path), "llamacpp", extra=["gate.engines=[harness,reference,llamacpp]"])
    assert set(report["engines"]) == {"harness", "reference", "llamacpp"}
    leg = report["engines"]["llamacpp"]
    assert leg["passed"] and leg["outputs_equal_captured"] == 3, leg
    assert report["passed"]
    parity = report["llamacpp_harness_rounds"]
    assert len(parity["per_sequence"]) == 3 and all(p["agree"] == 40 for p in parity["per_sequence"])
    assert 0 <= parity["equal"] <= parity["aligned"]
    anchored = report["llamacpp_harness_rounds_anchored"]  # llama.cpp's rounds anchored where the harness's are
    assert anchored["sequences"] and 0 < anchored["aligned"] and anchored["equal"] <= anchored["aligned"]


def imported_packages(folder: str) -> dict[str, set[str]]:
    """file -> the top-level packages its import statements name (lazy imports in functions included)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    out = {}
    for path in sorted((root / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(root))] = names
    return out


def test_the_gate_sits_above_the_stages_and_no_stage_imports_another():
    """The house's arrows: `pipeline`, `trainer`, `harness` import the core and never each other; the gate, above
    them, imports all three; nothing of the core, the stages or the Hydra entry imports the gate."""
    stages = {"pipeline", "trainer", "harness"}
    forbidden = {"flashdraft": stages | {"gate"}, "entry": stages | {"gate"}}
    forbidden |= {stage: stages - {stage} | {"gate"} for stage in stages}
    crossing = [
        f"{path} imports {sorted(names & forbidden[folder])}"
        for folder in forbidden
        for path, names in imported_packages(folder).items()
        if names & forbidden[folder]
    ]
    assert not crossing, crossing
    assert stages <= set().union(*imported_packages("gate").values())


def test_no_two_modules_import_each_other():
    """No circle of imports among the project's modules (lazy imports in functions included): a name imported from
    a package counts as its submodule where it is one, else as the package."""
    import ast
    import graphlib

    root = Path(__file__).resolve().parents[1]
    files = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for folder in ("flashdraft", "pipeline", "trainer", "harness", "gate", "entry")
        for p in (root / folder).rglob("*.py")
    }

    def module_of(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        named = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                named |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[module] = {m for m in map(module_of, named) if m and m != module}
    graphlib.TopologicalSorter(graph).prepare()  # CycleError names the circle
