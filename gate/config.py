"""The gate's settings: conf/config.yaml with the gate's defaults and the user's overrides, the data and train
settings it derives from the `gate` node, and what it refuses before touching anything (an unknown or unbuilt engine,
an unreadable target)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from entry import compose, typed_config
from entry.ranges import check_target_lengths
from flashdraft.config import GATE_ENGINES, GATE_PLANTS, Config

GATE_OVERRIDES = [  # before the user's overrides, which win
    "cluster.num_actors=0",  # capture in this process
    "model.dtype=float32",  # capture and serve alike, no near-tie flips between batch shapes
    "data.sources=[humaneval]",
    "data.batch_size=1",
    "data.store.dtype=float32",  # the features the drafter trains on are the ones it is served (bf16 storage: not)
    # every anchor of every sequence in each step: the training tau that stops training is then the tau of every
    # block the drafter will serve, not of a random few (8 anchors a sequence stopped at a lucky step's 15.72 and
    # served 13.26 on the embedded default)
    "train.num_anchors=512",
    "train.token_budget=8192",
    "train.wandb.mode=disabled",
]


class GateRefused(ValueError):
    """An engine or a setting the gate cannot run here (exit 2)."""


def gate_config(overrides: list[str]) -> Config:
    """conf/config.yaml with the gate's defaults and `overrides`, the data and train settings the gate derives from
    `gate` filled in."""
    try:  # every numeric gate.* setting is checked with the others (entry.ranges)
        cfg = typed_config(compose([*GATE_OVERRIDES, *overrides]))
    except ValueError as e:
        raise GateRefused(str(e)) from e
    g = cfg.gate
    if g.plant is not None and g.plant not in GATE_PLANTS:
        raise GateRefused(f"gate.plant must be null or one of {list(GATE_PLANTS)}, got {g.plant!r}")
    out = Path(g.out_dir)
    cfg.features_dir = str(out / "features")
    cfg.drafter_dir = str(out / "drafter")
    cfg.data = replace(
        cfg.data, limit=g.sequences, split="train", turns="single", max_new_tokens=g.max_new_tokens, mode="regenerate"
    )
    cfg.train = replace(
        cfg.train,
        stores=[cfg.features_dir],
        eval_stores=None,
        out_dir=str(out / "train"),
        drafter_dir=cfg.drafter_dir,
        target=cfg.model.target,
        max_steps=g.max_steps,
        epochs=g.max_steps,  # one step an epoch at least: max_steps binds
        stop_tau=g.train_tau * cfg.drafter.block_size,
        stop_steps=g.stable_steps,
        heldout_fraction=0.0,
        eval_every=0,
        checkpoint_every=0,
        keep_checkpoints=1,
        resume=False,
    )
    return cfg


def check_engines(engines) -> list[str]:
    """The engines asked for, refused by name where unknown or where the gate cannot run them (llamacpp)."""
    engines = [str(e) for e in engines]
    unknown = [e for e in engines if e not in GATE_ENGINES]
    if unknown or not engines:
        raise GateRefused(f"gate.engines must name some of {list(GATE_ENGINES)}, got {engines}")
    if "llamacpp" in engines:
        from harness.llamacpp import tool_path

        tool = tool_path("llama-speculative-simple")
        if not tool.is_file():
            raise GateRefused(
                f"engine llamacpp refused: no cached llama.cpp build ({tool} is missing) and the gate does not build "
                "it; run `make llamacpp` where a package index is reachable, or leave llamacpp out of ENGINES"
            )
    return engines


def check_target(cfg: Config) -> None:
    """Refuse, before anything is written, a target whose config cannot be read (a missing folder, an unreachable
    hub id) or whose positions data.max_length passes."""
    from pipeline.job import target_config

    try:
        config = target_config(cfg.model.target, cfg.trust_remote_code)
        check_target_lengths(cfg.data.max_length, config, cfg.model.target)
    except (OSError, ValueError) as e:
        raise GateRefused(f"model.target={cfg.model.target}: {e}") from e
