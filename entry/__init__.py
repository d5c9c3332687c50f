"""What the three entry points (`python -m pipeline | trainer | harness`) share and the stages must not know: the
typed schema (flashdraft.config) registered with Hydra, and a composed config turned into those typed settings once,
at the entry, so that no DictConfig travels further. Not in the core, which knows no Hydra; not in a stage, as no
stage imports another."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from entry.ranges import check_settings
from flashdraft.config import Config, checked_settings, refuse_unknown

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def register_configs() -> None:
    """Make the schema known to Hydra as `schema` (conf/config.yaml builds on it). Call before composing."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=Config)


def as_settings(node, schema: type, group: str):
    """A composed group (or a plain mapping) as a `schema` instance; keys it does not know (a retired option, a typo,
    a `+key=value` Hydra let in) are refused by name."""
    if not OmegaConf.is_config(node):
        return checked_settings(dict(node), schema, group)
    refuse_unknown(OmegaConf.to_container(node, resolve=False), schema, group)
    return OmegaConf.to_object(node)


def typed_config(cfg: DictConfig) -> Config:
    """The whole composed config as the typed `Config`, every group checked: keys known, every numeric setting in
    its range (entry.ranges); what an entry point hands its stage."""
    config = as_settings(cfg, Config, "")
    check_settings(config)
    return config


def compose(overrides: list[str]) -> DictConfig:
    """conf/config.yaml composed with `overrides`, without a Hydra run (nothing is written)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))
