"""The peer's own DFlash tests as an outside check of the drafters we export in its format (vLLM's `speculators`,
flashdraft.speculators_format), on a CPU.

    python benchmarks/peer_suite.py --peer-git /work/.mirror/vllm-project+speculators/repo
    python benchmarks/peer_suite.py --peer-git DIR --scratch /tmp/peer-suite --keep

Into a scratch folder (never this checkout): the peer repository's tests/ (from its git directory, `git archive`), a
tiny Qwen3 verifier shaped like the peer's integration fixtures (tests/integration/conftest.py: vocab 128, hidden 64,
4 heads of 16), and one of our drafters (random, 2 layers reading 3 target layers, block 4, mask token 0, the
fixtures' shape) exported by our trainer's exporter and then in the peer's format. Then, with pytest:

* the peer's DFlash unit tests as they are (its config, mask, metric, anchor and converter tests: they build their own
  tiny models, and check that the peer runs here beside our transformers);
* its DFlash integration tests (forward + backward through its loss, several batches and masks, block sizes, anchor
  counts, attention backends and their parity), whose model factory `make_dflash_model` is replaced by a loader of
  our exported folder (`DFlashDraftModel.from_pretrained`, the embedding and head from the verifier), moved from
  cuda:0 to the CPU (`EDITS`: the only edits of the copies). What a CPU lacks, the loader works around: attention is
  eager where a test asks for the default (flex has no CPU backward), a flex model takes no gradient (the parity
  tests that ask for flex never take one), and the default loss (kl_div) is the peer's eager implementation (its fused
  one needs Triton). A test asking for a reduced draft vocabulary (its own lm_head and d2t/t2d) is skipped, which
  our drafters never have;
* the peer's converter of z-lab checkpoints run on our z-lab export (`DFlashConverter.convert`, its own validation
  included), its folder compared with ours: the same config fields and bitwise the same tensors.

Prints each test's outcome (and why for a skip or a failure) and the counts; the peer is imported from the
environment (scripts/setup.sh installs it) or from PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec
from flashdraft.speculators_format import to_speculators
from trainer.checkpoint import export_drafter

UNIT = [
    "tests/unit/models/test_dflash_attention.py",
    "tests/unit/models/test_dflash_metrics.py",
    "tests/unit/models/test_dflash_targets.py",
    "tests/unit/models/test_dflash_utils.py",
    "tests/unit/models/test_sample_from_anchor.py",
    "tests/unit/test_model.py",
    "tests/unit/convert/test_dflash_converter.py",
]
INTEGRATION = [
    "tests/integration/models/test_model_forward.py::TestTraining",
    "tests/integration/models/test_model_forward.py::TestMultiBatch",
    "tests/integration/models/test_model_forward.py::TestVocabBoundary",
    "tests/integration/models/test_model_forward.py::TestDFlashParams",
    "tests/integration/models/test_dflash_vllm_parity.py",
]
# The peer's integration fixtures' verifier (tests/integration/conftest.py TINY_QWEN3_CONFIG), with 4 layers so that
# our drafter reads layers 0, 1, 2 (the peer's 1, 2, 3) as its 3 x hidden features.
VERIFIER = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# Appended to the copy of tests/integration/conftest.py: the factory loads our exported drafter instead.
LOADER = '''

def make_dflash_model(*, draft_vocab_size=64, block_size=4, draft_attn_impl=None, device="cpu", dtype=torch.bfloat16):
    """flashdraft's peer suite: our drafter exported in the peer's format, loaded by the peer's class."""
    if draft_vocab_size == 32:  # only the reduced-vocabulary fixture asks for 32 (d2t/t2d): ours never have one
        pytest.skip("a reduced draft vocabulary (d2t/t2d): our exported drafters score the whole vocabulary")
    config = DFlashSpeculatorConfig.from_pretrained(OUR_DRAFTER)
    config.block_size = block_size
    config.transformer_layer_config._attn_implementation = draft_attn_impl or "eager"
    model = DFlashDraftModel.from_pretrained(OUR_DRAFTER, config=config)
    if draft_attn_impl == "simple_flex_attention":  # asked by the parity tests alone, which take no gradient:
        model.requires_grad_(False)  # flex has no CPU backward, and refuses inputs that require grad
    from speculators.losses.utils import resolve_loss_config

    eager_loss = resolve_loss_config("kl_div", "eager")  # the default loss, kl_div, without Triton (a GPU's)
    forward = model.forward
    model.forward = lambda *a, loss_config=None, **k: forward(*a, loss_config=loss_config or eager_loss, **k)
    return model.to(device="cpu", dtype=dtype)
'''


def extract_tests(peer_git: Path, scratch: Path) -> None:
    """The peer repository's tests/ and pyproject.toml (its pytest markers) into `scratch`, from its git directory."""
    archive = subprocess.run(
        ["git", f"--git-dir={peer_git}", "archive", "HEAD", "tests", "pyproject.toml"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)


# The only edits of the copies, (file, text, replacement): each must be found. requires_cuda runs here; cuda:0 becomes
# the CPU; make_batch moves tensors only (0.9.0's CollateFn adds an int `error_records`, which the mirror's tests
# predate; 0.9.0's own trainer moves tensors only and passes the rest as they are).
EDITS = [
    ("conftest.py", "not torch.cuda.is_available()", "False"),
    ("integration/conftest.py", '"cuda:0"', '"cpu"'),
    (
        "integration/conftest.py",
        "{k: v.to(device) for k, v in batch.items()}",
        "{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}",
    ),
    ("integration/models/test_dflash_vllm_parity.py", '"cuda:0"', '"cpu"'),
]


def cpu_copies(scratch: Path, drafter: Path) -> None:
    """The integration copies moved to the CPU (`EDITS`), their DFlash factory loading `drafter`."""
    for rel, text, replacement in EDITS:
        path = scratch / "tests" / rel
        source = path.read_text()
        if text not in source:
            raise SystemExit(f"peer suite: {rel} no longer holds {text!r}: update EDITS for this peer checkout")
        path.write_text(source.replace(text, replacement))
    conftest = scratch / "tests" / "integration" / "conftest.py"
    conftest.write_text(conftest.read_text() + f"\nOUR_DRAFTER = {str(drafter)!r}\n" + LOADER)


def our_export(scratch: Path) -> tuple[Path, Path, Path]:
    """(verifier folder, our z-lab export, its peer-format copy): a tiny verifier and a random drafter of ours."""
    torch.manual_seed(0)
    verifier = scratch / "verifier"
    Qwen3ForCausalLM(Qwen3Config(**VERIFIER)).save_pretrained(verifier)
    spec = DraftSpec([0, 1, 2], mask_token_id=0, block_size=4, num_draft_layers=2)
    config = spec.draft_config(Qwen3Config(**VERIFIER))
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    zlab = export_drafter(DFlashDrafter, config, drafter.state_dict(), scratch / "drafter")
    return verifier, zlab, to_speculators(zlab, scratch / "drafter-speculators", str(verifier))


def run_pytest(scratch: Path, targets: list[str], name: str, *options: str) -> list[tuple[str, str, str]]:
    """(test id, outcome, why) of the peer's tests `targets`, run from `scratch` (its tests package importable); a
    test that needed the hub (no network here) is "no network"."""
    report = scratch / f"{name}.xml"
    env_path = str(scratch)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}"]
    subprocess.run(
        [*cmd, "--rootdir", str(scratch), *options, *targets],
        cwd=scratch,
        env={**os.environ, "PYTHONPATH": env_path, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, why = tag, (found.get("message") or "").split("\n")[0][:160]
        if outcome == "failure" and "huggingface.co" in why:
            outcome = "no network"
        rows.append((test_id, outcome, why))
    return rows


def converter_check(scratch: Path, verifier: Path, zlab: Path, ours: Path) -> list[str]:
    """The peer's converter on our z-lab export, its folder against ours: the differences (none: [])."""
    from speculators.convert.dflash.converter import DFlashConverter

    theirs = scratch / "converted"
    DFlashConverter().convert(zlab, theirs, base_model=str(verifier), validate=True)
    a, b = (json.loads((p / "config.json").read_text()) for p in (theirs, ours))
    keys = ["speculators_model_type", "draft_vocab_size", "block_size", "aux_hidden_state_layer_ids", "mask_token_id"]
    keys += ["sample_from_anchor", "speculators_config"]
    problems = [f"{k}: peer {a.get(k)!r} != ours {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
    layer_keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim"]
    layer_keys += ["num_key_value_heads", "rms_norm_eps", "rope_parameters", "vocab_size"]
    ta, tb = a["transformer_layer_config"], b["transformer_layer_config"]
    problems += [
        f"transformer_layer_config.{k}: {ta.get(k)!r} != {tb.get(k)!r}" for k in layer_keys if ta.get(k) != tb.get(k)
    ]
    sa, sb = (load_file(str(p / "model.safetensors")) for p in (theirs, ours))
    if set(sa) != set(sb):
        problems.append(
            f"tensor names differ: peer only {sorted(set(sa) - set(sb))}, ours only {sorted(set(sb) - set(sa))}"
        )
    problems += [f"tensor {k} differs" for k in set(sa) & set(sb) if not torch.equal(sa[k], sb[k])]
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-git", type=Path, required=True, help="the peer repository's git directory")
    parser.add_argument("--scratch", type=Path, help="the scratch folder (default: a new one under /tmp)")
    args = parser.parse_args(argv)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="peer-suite-"))
    scratch.mkdir(parents=True, exist_ok=True)
    extract_tests(args.peer_git, scratch)
    verifier, zlab, ours = our_export(scratch)
    cpu_copies(scratch, ours)
    rows = run_pytest(scratch, UNIT, "unit") + run_pytest(scratch, INTEGRATION, "integration", "-k", "dflash")
    for test_id, outcome, why in rows:
        print(f"{outcome:8s} {test_id}" + (f"  ({why})" if why else ""))
    counts = {o: sum(r[1] == o for r in rows) for o in ("passed", "failure", "error", "skipped", "no network")}
    print("peer tests:", ", ".join(f"{n} {o}" for o, n in counts.items()), f"(scratch {scratch})")
    problems = converter_check(scratch, verifier, zlab, ours)
    print("peer converter on our z-lab export:", "same config fields and tensors as ours" if not problems else "")
    for line in problems:
        print("  " + line)
    return int(bool(problems) or counts["failure"] + counts["error"] > 0)


if __name__ == "__main__":
    sys.exit(main())
