"""`python -m trainer model=... train=cpu|paper train.lr=...` (and `-m` sweeps)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import replace

import hydra
from omegaconf import DictConfig

from entry import register_configs, typed_config
from flashdraft.config import Config, TrainConfig
from trainer.launch import local_ranks, torchrun_command
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
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = local_ranks(os.environ, gpus, device, sweep=sweep)
    if ranks > 1:
        command = torchrun_command(ranks, sys.argv[1:])
        print(f"{gpus} GPUs visible: one rank per GPU: {shlex.join(command)}", flush=True)
        os.execv(command[0], command)


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
    config = typed_config(cfg)  # once, here: the trainer gets typed settings
    train(train_config(config, subdir), config.drafter)


if __name__ == "__main__":
    main()
