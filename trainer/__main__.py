"""`python -m trainer model=... train=cpu|paper train.lr=...` (and `-m` sweeps)."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import hydra
from omegaconf import DictConfig

from entry import register_configs, typed_config
from flashdraft.config import Config, TrainConfig
from trainer.train import train


def train_config(cfg: Config, sweep_subdir: str | None = None) -> TrainConfig:
    """The train settings; a sweep's job trains into its own directory."""
    tc = replace(cfg.train)
    if sweep_subdir:
        tc.out_dir = os.path.join(tc.out_dir, sweep_subdir)
        tc.drafter_dir = os.path.join(tc.out_dir, "drafter")
    return tc


register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    subdir = None
    if hc.mode == RunMode.MULTIRUN:
        subdir = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", hc.job.override_dirname) or str(hc.job.num)
    config = typed_config(cfg)  # once, here: the trainer gets typed settings
    train(train_config(config, subdir), config.drafter)


if __name__ == "__main__":
    main()
