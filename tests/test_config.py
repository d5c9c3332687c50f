"""The Hydra configuration: every yaml under conf/ composes against the typed schema (flashdraft/config.py), the
profiles set their groups and the drafter's block size in one place, a bad key or value is refused by name, and each
default is stated once."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from entry import CONF_DIR as CONF
from entry import as_settings, register_configs, typed_config
from flashdraft.config import Config, DataConfig, DrafterConfig, EvalConfig, TrainConfig


def composed(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g in ("model", "data", "train", "eval", "cluster", "profile") for o in options(g)],
)
def test_every_yaml_composes_against_the_schema(group, option):
    extra = ["data.path=/tmp/prompts.jsonl"] if (group, option) == ("data", "local") else []
    cfg = composed(f"{group}={option}", *extra)
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, Config)
    assert isinstance(config.data, DataConfig) and isinstance(config.drafter, DrafterConfig)


def test_defaults_come_from_the_schema():
    config = OmegaConf.to_object(composed())
    assert config.model.name == "smollm2-135m" and config.data.name == "offline"
    assert config.drafter == DrafterConfig()  # DraftSpec's block and depth, the formula's layers
    assert config.features_dir == "runs/smollm2-135m/features"
    assert config.data.store.dtype == "bfloat16" and config.cluster.num_actors == "auto"


def test_a_profile_sets_its_groups_and_the_block_size_in_one_place():
    cfg = composed("profile=quick")
    assert (cfg.data.name, cfg.eval.name, cfg.drafter.block_size) == ("quick", "quick", 8)
    assert cfg.run_dir == "runs/quick-smollm2-135m" and cfg.train.max_steps == 600
    heldout = composed("profile=quick", "data=heldout", "drafter.block_size=4")
    assert heldout.data.name == "heldout" and heldout.drafter.block_size == 4  # the command line wins


def test_unknown_keys_and_wrong_types_are_refused_by_name():
    with pytest.raises(ConfigCompositionException, match="train.lrate"):
        composed("train.lrate=1e-3")
    with pytest.raises(ConfigCompositionException, match="drafter.block_size") as error:
        composed("drafter.block_size=sixteen")
    assert isinstance(error.value.__cause__, ValidationError)
    with pytest.raises(ConfigCompositionException, match="anchor_follow"):  # a retired option is gone, not ignored
        composed("train.anchor_follow=0.5")


def test_keys_added_with_plus_are_refused_when_a_stage_reads_its_group():
    cfg = composed("+train.anchor_follow=0.5", "+train.wandb.projekt=x")  # Hydra adds them to the structured node
    with pytest.raises(ValueError, match=r"unknown train settings \['anchor_follow', 'wandb.projekt'\]"):
        as_settings(cfg.train, TrainConfig, "train")
    settings = as_settings(composed("train.lr=1e-3").train, TrainConfig, "train")
    assert (
        isinstance(settings, TrainConfig) and settings.lr == 1e-3 and settings.stores == ["runs/smollm2-135m/features"]
    )


def test_the_whole_config_is_typed_once_and_unknown_keys_anywhere_are_refused():
    config = typed_config(composed("profile=quick"))
    assert isinstance(config, Config) and isinstance(config.eval, EvalConfig) and config.drafter.block_size == 8
    with pytest.raises(ValueError, match=r"unknown settings \['data.store.codek', 'model.chat.thinkin'\]"):
        typed_config(composed("+data.store.codek=zstd", "+model.chat.thinkin=true"))


def test_geometry_and_held_out_defaults_are_stated_once():
    """The drafter settings' defaults are DraftSpec's and the formula's; the data and eval held-out share is the
    prompts' (a change of either moves every stage)."""
    from flashdraft.prompts import DEFAULT_HELDOUT_FRACTION
    from flashdraft.spec import DEFAULT_NUM_FEATURES, DraftSpec

    spec = DraftSpec((1, 2), mask_token_id=0)
    drafter = DrafterConfig()
    assert (drafter.block_size, drafter.num_layers, drafter.intermediate_size) == (
        spec.block_size,
        spec.num_draft_layers,
        spec.intermediate_size,
    )
    assert drafter.num_features == DEFAULT_NUM_FEATURES
    assert DraftSpec.from_settings(drafter, (1, 2), 0) == spec
    assert DataConfig().heldout_fraction == EvalConfig().heldout_fraction == DEFAULT_HELDOUT_FRACTION


def test_the_core_knows_no_hydra():
    """flashdraft/ imports neither hydra nor omegaconf: the schema is plain dataclasses, registered by `entry`."""
    core = Path(__file__).resolve().parents[1] / "flashdraft"
    offenders = [
        str(p.relative_to(core))
        for p in core.rglob("*.py")
        if any(w in p.read_text() for w in ("import hydra", "from hydra", "import omegaconf", "from omegaconf"))
    ]
    assert offenders == []
