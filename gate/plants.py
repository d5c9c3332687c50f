"""`gate.plant`: a known train/serve mismatch put in on purpose, which the gate must fail on. labels+1 trains each
block position on the token after its own; layers-1 serves the drafter with every target layer id one lower."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from flashdraft.spec import aux_layer_ids
from gate.config import GateRefused


@contextlib.contextmanager
def planted_labels(plant: str | None):
    """labels+1: every block position learns the token after its own (the trainer's labels shifted by one)."""
    if plant != "labels+1":
        yield
        return
    import trainer.batch as batch

    original = batch.block_labels

    def shifted(input_ids, loss_mask, anchors, block_size, gamma):
        return original(input_ids, loss_mask, anchors + 1, block_size, gamma)

    batch.block_labels = shifted
    try:
        yield
    finally:
        batch.block_labels = original


def served_drafter(drafter_dir: Path, plant: str | None, out: Path) -> Path:
    """The folder the engines serve: the exported drafter, or (layers-1) a copy whose config.json names every target
    layer one lower (an engine that reads the ids without the +1 offset of `hidden_states`)."""
    if plant != "layers-1":
        return drafter_dir
    shutil.copytree(drafter_dir, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    ids = config["dflash_config"]["target_layer_ids"]
    if min(ids) < 1:
        raise GateRefused(f"gate.plant=layers-1 needs every target layer id >= 1, the drafter reads {ids}")
    config["dflash_config"]["target_layer_ids"] = [i - 1 for i in ids]
    if "eagle_aux_hidden_state_layer_ids" in config:  # derived from them (vLLM's convention): kept in agreement
        config.update(aux_layer_ids(config["dflash_config"]))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
