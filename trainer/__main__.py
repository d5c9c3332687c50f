"""`python -m trainer model=... train=cpu|paper train.lr=...` (and `-m` sweeps)."""

from __future__ import annotations

import os
import re

import hydra
from omegaconf import DictConfig, OmegaConf

from trainer.train import TrainConfig, train


def train_config(cfg: DictConfig, sweep_subdir: str | None = None) -> TrainConfig:
    t = OmegaConf.to_container(cfg.train, resolve=True)
    wandb = t.pop("wandb", {}) or {}
    t["stores"] = t["stores"] if isinstance(t["stores"], list) else [t["stores"]]
    t["compile"] = str(t["compile"]).lower()
    if sweep_subdir:  # each job of a sweep trains into its own directory
        t["out_dir"] = os.path.join(t["out_dir"], sweep_subdir)
        t["drafter_dir"] = os.path.join(t["out_dir"], "drafter")
    return TrainConfig(**t, wandb_mode=wandb.get("mode", "offline"), wandb_project=wandb.get("project", "flashdraft"),
                       wandb_entity=wandb.get("entity"), run_name=wandb.get("name"))


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    subdir = None
    if hc.mode == RunMode.MULTIRUN:
        subdir = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", hc.job.override_dirname) or str(hc.job.num)
    train(train_config(cfg, subdir))


if __name__ == "__main__":
    main()
