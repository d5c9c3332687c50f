"""The drafter a run trains: its spec, made here once from the feature stores and the config, and its first weights.

The target layer ids come from the stores' manifests (the layers the pipeline captured), optionally narrowed by
`drafter.layer_ids`; block size, depth and MLP width from the drafter settings (`DraftSpec.from_settings`); the mask
token from the target's tokenizer.
The spec goes into the drafter's config.json, from which everything after training reads it. A checkpoint records
the stores' feature basis (`features_basis`), and a resume on stores of another basis is refused (`check_basis`).
"""

from __future__ import annotations

import json
from pathlib import Path

from flashdraft.config import DrafterConfig, TrainConfig
from flashdraft.model import DFlashDrafter, lift_fc
from flashdraft.spec import DraftSpec
from flashdraft.store import read_manifest
from flashdraft.store.projection import Projection, load_projection
from flashdraft.target import (
    choose_mask_token,
    family_of,
    load_tokenizer,
    mask_token_string,
    read_target_tensors,
    target_fingerprint,
    text_config,
)
from trainer.checkpoint import CheckpointError
from trainer.store_check import check_store, store_layer_ids, store_projection_sha

RAW = "raw"  # the basis of stores of raw (unprojected) features


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


def stores_projection(cfg: TrainConfig, drafter: DrafterConfig) -> Projection | None:
    """The projection basis of the training and eval stores (its file's sha256 checked), None for raw features;
    mixed kinds or bases refused by name (`store_projection_sha`). The drafter then trains fc' on r inputs and is
    exported folded (`flashdraft.model.fold_projection`)."""
    paths = [*cfg.stores, *(cfg.eval_stores or [])]
    manifests = {path: read_manifest(path) for path in paths}
    sha = store_projection_sha(manifests, drafter.layer_ids)
    if sha is None:
        return None
    return load_projection(paths[0], manifests[paths[0]])


def features_basis(projection: Projection | None) -> str:
    """The stores' feature basis as a checkpoint records it: the sha256 of their projection file, or "raw"."""
    return projection.sha256 if projection is not None else RAW


def recorded_basis(checkpoint: Path, client_state: dict) -> str | None:
    """The basis the checkpoint was trained on: its client state's record, else (checkpoints saved before it was
    recorded) its exported drafter's `feature_projection`; None where neither says."""
    if client_state.get("features_basis"):
        return client_state["features_basis"]
    config = checkpoint / "drafter" / "config.json"
    try:
        exported = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    projection = exported.get("feature_projection") if isinstance(exported, dict) else None
    return projection.get("sha256") if isinstance(projection, dict) else RAW


def _describe_basis(basis: str) -> str:
    return "raw features" if basis == RAW else f"features projected by the basis sha256 {basis[:12]}"


def check_basis(checkpoint: Path, client_state: dict, projection: Projection | None, stores) -> None:
    """Refuse a resume from `checkpoint` on stores whose basis is not the one it was trained on (a store recreated
    at the same path): its fc' would be folded with another basis, or not fit fc's shape."""
    recorded, found = recorded_basis(checkpoint, client_state), features_basis(projection)
    if recorded is None or recorded == found:
        return
    harm = "fold an fc' trained on one basis with the other" if RAW not in (recorded, found) else "not fit fc's shape"
    raise CheckpointError(
        f"train.stores {list(stores)} hold {_describe_basis(found)}, but the checkpoint {checkpoint} was trained on "
        f"{_describe_basis(recorded)}: resuming it would {harm}; refused. Train into a new train.out_dir, or point "
        f"train.stores back at the store(s) of {_describe_basis(recorded)}"
    )


def projected_config(draft_config, projection: Projection | None):
    """The drafter's config for training on `projection`'s features: `feature_projection` records the basis (not yet
    folded: fc reads its r dims); unchanged for raw features."""
    if projection is not None:
        draft_config.feature_projection = {**projection.provenance(), "folded": False}
    return draft_config


def init_weights(model: DFlashDrafter, init: str, target: str, target_config, projection=None) -> None:
    """train.init: "random" keeps the fresh weights; "target" starts the draft layers as the target's top layers;
    anything else is a drafter folder to fine-tune. On a projected store (`projection`) the fc of either start,
    which reads raw features, is lifted to the basis's r inputs (`flashdraft.model.lift_fc`: exact for a drafter
    exported from the same basis)."""
    lift = projection.lift if projection is not None else None
    if init == "target":
        n = text_config(target_config).num_hidden_layers
        wanted = tuple(f".layers.{j}." for j in range(n - model.config.num_hidden_layers, n))
        tensors = read_target_tensors(
            target, lambda name: name.endswith("norm.weight") or any(w in name for w in wanted)
        )
        model.init_from_target(tensors, prefix=family_of(target_config).decoder_prefix(tensors), lift=lift)
    elif init != "random":
        init_from_drafter(model, init, lift)


def init_from_drafter(drafter: DFlashDrafter, path, lift=None) -> None:
    """Start from an exported drafter's weights (fine-tuning); it must have this run's shape (its fc lifted to the
    r inputs of a projected store by `lift`)."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"train.init must be 'random', 'target' or a drafter folder; {path!r} holds no config.json")
    source = DFlashDrafter.from_pretrained(path)
    theirs, ours = source.state_dict(), drafter.state_dict()
    if lift is not None and theirs["fc.weight"].shape[1] == lift.shape[0]:
        theirs["fc.weight"] = lift_fc(theirs["fc.weight"], lift)
    wrong = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
    if wrong:
        raise ValueError(
            f"train.init={path}: the drafter there has another shape than this run's ({len(wrong)} "
            f"tensors differ, first {wrong[0]!r})"
        )
    drafter.load_state_dict(theirs)
