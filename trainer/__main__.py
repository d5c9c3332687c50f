"""`python -m trainer model=... train=auto|cpu|quick|full|paper train.lr=...` (and `-m` sweeps)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import replace

import hydra
import torch
from omegaconf import DictConfig

from entry import register_configs, typed_config
from flashdraft.config import Config, TrainConfig
from trainer.launch import local_ranks, torchrun_command
from trainer.settings import trains_on_cuda
from trainer.train import train


def train_config(cfg: Config, sweep_subdir: str | None = None) -> TrainConfig:
    """The train settings; a sweep's job trains into its own directory."""
    tc = replace(cfg.train)
    if sweep_subdir:
        tc.out_dir = os.path.join(tc.out_dir, sweep_subdir)
        tc.drafter_dir = os.path.join(tc.out_dir, "drafter")
    return tc


def relaunch_per_gpu(device: str, *, sweep: bool) -> None:
    """On a machine with several visible GPUs and no launcher, replace this process with torchrun running one rank
    per GPU (`trainer.launch.local_ranks`); `CUDA_VISIBLE_DEVICES` picks which GPUs, one of them trains alone."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = local_ranks(os.environ, gpus, device, sweep=sweep)
    if ranks > 1:
        command = torchrun_command(ranks, sys.argv[1:])
        print(f"{gpus} GPUs visible: one rank per GPU: {shlex.join(command)}", flush=True)
        os.execv(command[0], command)


def auto_recipe(device: str, cuda_available: bool) -> tuple[str, str]:
    """The train profile `train=auto` stands for, and why: paper (the GPU recipe) where the trainer will train on CUDA
    (`trainer.settings.trains_on_cuda`, as the trainer resolves its device), cpu elsewhere."""
    if trains_on_cuda(device, cuda_available):
        return "paper", "CUDA available" if str(device).lower() == "auto" else f"train.device={device}"
    return "cpu", "no CUDA device" if str(device).lower() == "auto" else f"train.device={device}"


def with_train_recipe(cfg: DictConfig, choice: str, overrides: list[str], cuda_available: bool) -> DictConfig:
    """`cfg` as composed, or, where its train group is `auto` (`choice`), composed again with the train profile
    `auto_recipe` picks and the same `overrides`, so each train.* override still wins over the recipe's values.
    Says what it chose, on rank 0. Composes with Hydra's compose API: call it inside a Hydra app or an
    `initialize_config_dir` context."""
    if choice != "auto":
        return cfg
    from hydra import compose

    recipe, why = auto_recipe(cfg.train.device, cuda_available)
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "train"]
    cfg = compose(config_name="config", overrides=[*kept, f"train={recipe}"])
    if os.environ.get("RANK", "0") == "0":
        t = cfg.train
        print(
            f"train=auto: {why} -> the {recipe} recipe (conf/train/{recipe}.yaml: dtype {t.dtype}, attention "
            f"{t.attention}, compile {t.compile}, {t.num_anchors} anchors, max_length {t.max_length}, token_budget "
            f"{t.token_budget}; train.* overrides win)",
            flush=True,
        )
    return cfg


register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    relaunch_per_gpu(cfg.train.device, sweep=hc.mode == RunMode.MULTIRUN)
    subdir = None
    if hc.mode == RunMode.MULTIRUN:
        subdir = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", hc.job.override_dirname) or str(hc.job.num)
    cfg = with_train_recipe(cfg, hc.runtime.choices.get("train"), list(hc.overrides.task), torch.cuda.is_available())
    try:
        config = typed_config(cfg)  # once, here: the trainer gets typed settings (their ranges checked)
    except ValueError as e:  # a bad setting: its key and range, without a traceback
        raise SystemExit(f"error: {e}") from None
    train(train_config(config, subdir), config.drafter)


if __name__ == "__main__":
    main()
