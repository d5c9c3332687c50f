"""The drafter a run trains: its spec, made here once from the feature stores and the config, and its first weights.

The target layer ids come from the stores' manifests (the layers the pipeline captured), optionally narrowed by
`drafter.layer_ids`; block size, depth and MLP width from the drafter settings (`DraftSpec.from_settings`); the mask
token from the target's tokenizer.
The spec goes into the drafter's config.json, from which everything after training reads it.
"""

from __future__ import annotations

from pathlib import Path

from flashdraft.config import DrafterConfig, TrainConfig
from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec
from flashdraft.store import read_manifest
from flashdraft.target import (
    choose_mask_token,
    family_of,
    load_tokenizer,
    mask_token_string,
    read_target_tensors,
    target_fingerprint,
    text_config,
)
from trainer.store_check import check_store, store_layer_ids


def drafter_spec(cfg: TrainConfig, drafter: DrafterConfig, target_config) -> DraftSpec:
    """The spec of the drafter to train on `cfg`'s training and eval stores, each checked against the target."""
    tc = text_config(target_config)
    manifests = {path: read_manifest(path) for path in [*cfg.stores, *(cfg.eval_stores or [])]}
    fingerprint = target_fingerprint(cfg.target) if cfg.check_target else None
    for path, manifest in manifests.items():
        check_store(path, manifest, hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, target=fingerprint)
    tokenizer = load_tokenizer(cfg.target)
    mask_token_id = choose_mask_token(tokenizer, tc.vocab_size, family=family_of(target_config))
    layer_ids = store_layer_ids(manifests, drafter.layer_ids)
    return DraftSpec.from_settings(drafter, layer_ids, mask_token_id, mask_token_string(tokenizer, mask_token_id))


def trained_thinking(modes) -> str | None:
    """The thinking mode a drafter is trained in, from its training sequences' recorded modes (True, False, None:
    not recorded): "on", "off", "mixed", or None where no sequence recorded one (a target without thinking, or
    stores older than the record). Exported as config.json's `flashdraft_trained_thinking`: the harness warns when it
    evaluates another mode."""
    seen = {bool(m) for m in modes if m is not None}
    if not seen:
        return None
    return "mixed" if len(seen) == 2 else ("on" if True in seen else "off")


def init_weights(model: DFlashDrafter, init: str, target: str, target_config) -> None:
    """train.init: "random" keeps the fresh weights; "target" starts the draft layers as the target's top layers;
    anything else is a drafter folder to fine-tune."""
    if init == "target":
        n = text_config(target_config).num_hidden_layers
        wanted = tuple(f".layers.{j}." for j in range(n - model.config.num_hidden_layers, n))
        tensors = read_target_tensors(
            target, lambda name: name.endswith("norm.weight") or any(w in name for w in wanted)
        )
        model.init_from_target(tensors, prefix=family_of(target_config).decoder_prefix(tensors))
    elif init != "random":
        init_from_drafter(model, init)


def init_from_drafter(drafter: DFlashDrafter, path) -> None:
    """Start from an exported drafter's weights (fine-tuning); it must have this run's shape."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"train.init must be 'random', 'target' or a drafter folder; {path!r} holds no config.json")
    source = DFlashDrafter.from_pretrained(path)
    theirs, ours = source.state_dict(), drafter.state_dict()
    wrong = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
    if wrong:
        raise ValueError(
            f"train.init={path}: the drafter there has another shape than this run's ({len(wrong)} "
            f"tensors differ, first {wrong[0]!r})"
        )
    drafter.load_state_dict(theirs)
