"""The drafter spec is made once, from the feature stores and the config: layer ids from the stores' manifests
(optionally narrowed), the mask token from the target's tokenizer, the rest from the drafter config."""

import pytest

from flashdraft.config import DrafterConfig
from tests.test_trainer_fixtures import MASK, STORE_LAYERS, configs, tiny_store, tiny_target, train_kwargs
from trainer.drafter import drafter_spec
from trainer.store_check import StoreMismatch, store_layer_ids


def test_layer_ids_are_the_ones_the_stores_hold():
    manifests = {"a": {"layer_ids": [1, 8, 14, 20, 27]}, "b": {"layer_ids": [1, 8, 14, 20, 27]}}
    assert store_layer_ids(manifests) == [1, 8, 14, 20, 27]
    assert store_layer_ids({"a": {"layer_ids": [2, 5]}}) == [2, 5]


def test_stores_that_hold_other_layers_are_named_with_their_ids():
    manifests = {"runs/a": {"layer_ids": [1, 3, 4]}, "runs/b": {"layer_ids": [1, 3]}}
    with pytest.raises(StoreMismatch, match=r"different target layers \(runs/a: \[1, 3, 4\]; runs/b: \[1, 3\]\)"):
        store_layer_ids(manifests)
    assert store_layer_ids(manifests, [3, 1]) == [3, 1]  # layers both hold, in the order asked for


def test_asked_layer_ids_must_be_in_every_store():
    manifests = {"runs/a": {"layer_ids": [1, 3, 4]}, "runs/b": {"layer_ids": [1, 4]}}
    assert store_layer_ids(manifests, [1, 4]) == [1, 4]
    with pytest.raises(
        StoreMismatch, match=r"layer_ids \[1, 3\] are not all in the feature stores \(runs/b: \[1, 4\]\)"
    ):
        store_layer_ids(manifests, [1, 3])


def test_the_spec_takes_the_stores_layers_the_tokenizers_mask_and_the_drafter_configs_shape(tmp_path):
    """A store that still names a mask token in its manifest (older captures did) trains with the tokenizer's."""
    from flashdraft.target import load_config

    target = tiny_target(tmp_path / "target")
    store = tiny_store(tmp_path / "store", target, n=4, extra={"mask_token_id": 5})
    heldout = tiny_store(tmp_path / "heldout", target, n=4, seed=1)
    cfg, _ = configs(train_kwargs(tmp_path, store.path, target, eval_stores=[str(heldout.path)]))
    drafter = DrafterConfig(block_size=8, num_layers=3, intermediate_size=96)
    spec = drafter_spec(cfg, drafter, load_config(str(target)))
    assert spec.target_layer_ids == tuple(STORE_LAYERS) and spec.mask_token_id == MASK
    assert (spec.block_size, spec.num_draft_layers, spec.intermediate_size) == (8, 3, 96)
    assert drafter_spec(cfg, DrafterConfig(layer_ids=[4, 1]), load_config(str(target))).target_layer_ids == (4, 1)

    other = tiny_store(tmp_path / "other", target, n=4, layers=[1, 3])  # an eval store of another capture
    cfg.eval_stores = [str(other.path)]
    with pytest.raises(StoreMismatch, match=rf"{tmp_path / 'other'}: \[1, 3\]"):
        drafter_spec(cfg, drafter, load_config(str(target)))
