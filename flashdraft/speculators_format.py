"""Drafters in the peer's format: vLLM's `speculators` library (release 0.9.0), its `DFlashSpeculatorConfig` and
`DFlashDraftModel`, beside the published z-lab format our `DFlashDrafter` writes.

The two hold the same network under the same tensor names (`layers.N.*`, `fc`, `hidden_norm`, `norm`; neither saves
the embedding or the output head, both borrowed from the target, which the peer calls the verifier) and differ in
config.json only: the peer nests the draft layers' Qwen3 geometry in `transformer_layer_config` and names the target
layers it reads `aux_hidden_state_layer_ids`, in another convention than ours (`aux_layer_ids_of`).

`to_speculators` writes a folder `DFlashDraftModel.from_pretrained(folder)` loads (it rebuilds the embedding, the
output head and `verifier_norm` from the verifier named in `speculators_config.verifier.name_or_path`);
`from_speculators` reads one back as our config and tensors, refusing, field by field, what our drafter cannot
compute alike (`crossing_problems`). `DFlashDrafter.from_pretrained` calls it for a folder whose config.json has
`speculators_model_type`. The peer itself is never imported here (it is no dependency of the project): its config
schema is written and read by hand, and tests/test_speculators_format.py checks both ways against the peer's classes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3Config

from flashdraft.spec import TRAINED_THINKING_KEY, DraftSpec, export_config, legacy_rope

SPECULATORS_VERSION = "0.9.0"  # the peer's release whose schema this writes and reads
PEER_SUFFIX = "-speculators"  # the trainer's export writes the peer's folder at <drafter>-speculators beside it
# Tensors the peer rebuilds from the verifier when it loads (DFlashDraftModel._keys_to_ignore_on_load_missing); a
# full-vocabulary drafter's lm_head is the verifier's head, frozen. Ours borrows them from the target: dropped on read.
VERIFIER_OWNED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
# Our config keys the peer has no field for, carried under this key of the peer's config.json (its config class
# allows extra keys) so that a drafter crossing there and back keeps them.
OURS_KEY = "flashdraft"
OUR_KEYS = ("num_target_layers", TRAINED_THINKING_KEY, "feature_projection")
# The draft layers' geometry, as transformer_layer_config holds it (a Qwen3 config's keys).
LAYER_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "initializer_range",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
)


def aux_layer_ids_of(target_layer_ids) -> list[int]:
    """Our target layer ids in the peer's convention. Ours name decoder layer outputs (id i: the output of layer i,
    `hidden_states[i + 1]` of transformers, index 0 being the embeddings; flashdraft.model.extract_context_feature);
    the peer's `aux_hidden_state_layer_ids` index that hidden_states tuple directly (the layer whose input is
    captured, as vLLM's aux hidden state hook does). Read in the peer's own converter of z-lab checkpoints
    (speculators 0.9.0, speculators/convert/dflash/converter.py: `i + 1 for i in target_layer_ids`) and in vLLM's
    reader of the peer's configs (vllm/transformers_utils/configs/speculators/algos.py, update_dflash:
    `eagle_aux_hidden_state_layer_ids = aux`, `dflash_config.target_layer_ids = [i - 1 for i in aux]`). Our id L-1
    (the last layer's output, before the final norm) is the peer's L; the peer's converter drops that id, counting
    on the verifier's last hidden state its datagen captures apart, which would narrow fc: we keep it, fc unchanged."""
    return [int(i) + 1 for i in target_layer_ids]


def _verifier_entry(verifier_name_or_path: str, architectures) -> dict:
    """speculators_config.verifier: the verifier's name or folder and its architectures (read from a local folder's
    config.json where not given). The embedded default's name resolves to its cached folder, which the peer reads."""
    from flashdraft.target.load import resolve_target

    path = resolve_target(str(verifier_name_or_path))
    if architectures is None:
        cfg = _local_config_file(path)
        architectures = (json.loads(cfg.read_text()).get("architectures") or []) if cfg else []
    return {"name_or_path": path, "architectures": list(architectures)}


def _local_config_file(name_or_path: str) -> Path | None:
    """A target's config.json on this machine (its folder's, or the hub cache's copy; never fetched), else None."""
    cfg = Path(name_or_path) / "config.json"
    if cfg.is_file():
        return cfg
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name_or_path, "config.json")
    except Exception:  # noqa: BLE001 - a folder name that is no valid repo id is simply not cached
        return None
    return Path(cached) if isinstance(cached, str) else None


def speculators_config(ours: dict, verifier_name_or_path: str, verifier_architectures=None) -> dict:
    """The peer's config.json dict for a drafter whose config.json (ours, z-lab format) is `ours`."""
    spec = DraftSpec.from_draft_config(ours)
    layer = {k: ours[k] for k in LAYER_KEYS if k in ours}
    layer.update(legacy_rope(layer.get("rope_parameters")))  # for readers on transformers 4, as our export writes
    layer["model_type"] = "qwen3"
    carried = {k: ours[k] for k in OUR_KEYS if ours.get(k) is not None}
    if spec.mask_token is not None:
        carried["mask_token"] = spec.mask_token
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": int(ours["vocab_size"]),  # the full vocabulary: no d2t/t2d mapping, no own lm_head
        "block_size": spec.block_size,
        "target_hidden_size": None,  # the draft's own hidden size
        "aux_hidden_state_layer_ids": aux_layer_ids_of(spec.target_layer_ids),
        "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,  # block position 0 holds the anchor; positions 1..B-1 are drafted
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": spec.block_size - 1,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": _verifier_entry(verifier_name_or_path, verifier_architectures),
        },
        "tie_word_embeddings": False,
        "dtype": ours.get("dtype", "float32"),
        OURS_KEY: carried,
    }


def _drafter_parts(drafter_dir_or_model) -> tuple[dict, dict, Path | None]:
    """(our config.json dict, tensors, folder or None) of a drafter folder or a DFlashDrafter."""
    if isinstance(drafter_dir_or_model, (str, os.PathLike)):
        folder = Path(drafter_dir_or_model)
        raw = json.loads((folder / "config.json").read_text())
        if "speculators_model_type" in raw:
            raise ValueError(f"{folder / 'config.json'} is already in the peer's format (speculators_model_type)")
        return raw, load_file(str(folder / "model.safetensors")), folder
    model = drafter_dir_or_model
    raw = export_config(model.config)
    raw["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    return raw, state, None


def to_speculators(drafter_dir_or_model, out_dir, verifier_name_or_path: str, verifier_architectures=None) -> Path:
    """Write the drafter (an exported folder or a DFlashDrafter) as the peer's folder at `out_dir` (config.json and
    model.safetensors, world-readable; replaced whole if it exists), naming `verifier_name_or_path` (a hub id, a
    folder, or our embedded default's name) the verifier the peer rebuilds the embedding and head from."""
    raw, state, folder = _drafter_parts(drafter_dir_or_model)
    projection = raw.get("feature_projection")
    if projection and not projection.get("folded", False):
        raise ValueError(
            f"{folder or 'the drafter'}: fc reads {projection.get('dims')} projected features (feature_projection "
            "not folded): export it first (trainer.checkpoint.export_drafter folds it), the peer reads raw features"
        )
    config = speculators_config(raw, verifier_name_or_path, verifier_architectures)
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in (tmp, *tmp.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def crossing_problems(raw: dict) -> list[str]:
    """Every field of the peer's config.json `raw` that our drafter cannot compute alike, each with why."""
    tl = raw.get("transformer_layer_config") or {}
    problems = []
    if raw.get("speculators_model_type") != "dflash":
        problems.append(
            f"speculators_model_type {raw.get('speculators_model_type')!r}: only 'dflash' has our network "
            "(dflash2, dspark and the others add modules)"
        )
    if raw.get("draft_vocab_size") not in (None, tl.get("vocab_size")):
        problems.append(
            f"draft_vocab_size {raw['draft_vocab_size']} != vocab_size {tl.get('vocab_size')}: a reduced draft "
            "vocabulary (its own lm_head and d2t/t2d mapping); ours scores the target's whole vocabulary"
        )
    sliding = [i for i, t in enumerate(tl.get("layer_types") or []) if t == "sliding_attention"]
    if sliding:
        problems.append(
            f"transformer_layer_config.layer_types: layers {sliding} are sliding_attention; ours attend to the "
            "whole context"
        )
    if raw.get("sample_from_anchor"):
        problems.append(
            "sample_from_anchor true: the anchor position drafts a token too; ours drafts positions 1..B-1 only"
        )
    aux = raw.get("aux_hidden_state_layer_ids")
    if not aux or any(int(i) < 1 for i in aux) or list(aux) != sorted(set(aux)):
        problems.append(
            f"aux_hidden_state_layer_ids {aux}: must be distinct, ascending and >= 1 (id 0 is the embeddings, which "
            "our target_layer_ids, decoder layer outputs, cannot name; engines concatenate in layer order)"
        )
    if raw.get("mask_token_id") is None:
        problems.append("mask_token_id missing: a DFlash drafter needs its mask token")
    if raw.get("target_hidden_size") not in (None, tl.get("hidden_size")):
        problems.append(
            f"target_hidden_size {raw['target_hidden_size']} != hidden_size {tl.get('hidden_size')}: ours reads "
            "features of its own width"
        )
    return problems


def _layer_config(tl: dict, where: str):
    """transformer_layer_config as the peer builds it: the config class of its model_type (Qwen3Config where
    absent; DFlashSpeculatorConfig.validate_transformer_config), so that keys left out take that class's defaults."""
    tl = dict(tl)
    model_type = tl.pop("model_type", "qwen3")
    try:
        cls = type(AutoConfig.for_model(model_type))
    except ValueError as exc:
        raise ValueError(f"{where}: transformer_layer_config.model_type {model_type!r} is unknown: {exc}") from None
    return cls(**tl)


def _verifier_layers(raw: dict) -> int | None:
    """The verifier's decoder layer count, where speculators_config.verifier names a folder or a cached hub id (never
    fetched)."""
    path = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    cfg = _local_config_file(path) if path else None
    if cfg is None:
        return None
    verifier = json.loads(cfg.read_text())
    return (verifier.get("text_config") or verifier).get("num_hidden_layers")


def our_config(raw: dict, where: str = "speculators config") -> dict:
    """Our config.json dict (z-lab format, as our export writes it) for the peer's config.json `raw`."""
    problems = crossing_problems(raw)
    if problems:
        raise ValueError(f"{where}: this drafter cannot cross to our format:\n  " + "\n  ".join(problems))
    tl = _layer_config(raw["transformer_layer_config"], where)
    carried = raw.get(OURS_KEY) or {}
    ids = [int(i) - 1 for i in raw["aux_hidden_state_layer_ids"]]
    spec = DraftSpec(
        target_layer_ids=ids,
        mask_token_id=int(raw["mask_token_id"]),
        block_size=int(raw["block_size"]),
        num_draft_layers=int(tl.num_hidden_layers),
        intermediate_size=int(tl.intermediate_size),
        mask_token=carried.get("mask_token"),
    )
    rope = getattr(tl, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(tl, "rope_theta", 10000.0),
    }
    if "sliding_attention" in rope:  # per-layer-type RoPE: the peer's flatten_rope_parameters takes this one
        rope = rope["sliding_attention"]
    num_target_layers = carried.get("num_target_layers") or _verifier_layers(raw)
    target_like = Qwen3Config(
        vocab_size=tl.vocab_size,
        hidden_size=tl.hidden_size,
        intermediate_size=tl.intermediate_size,
        num_hidden_layers=num_target_layers or max(ids) + 1,
        num_attention_heads=tl.num_attention_heads,
        num_key_value_heads=getattr(tl, "num_key_value_heads", None) or tl.num_attention_heads,
        head_dim=getattr(tl, "head_dim", None) or tl.hidden_size // tl.num_attention_heads,
        max_position_embeddings=tl.max_position_embeddings,
        rms_norm_eps=tl.rms_norm_eps,
        rope_parameters=dict(rope),
        bos_token_id=getattr(tl, "bos_token_id", None),
        eos_token_id=getattr(tl, "eos_token_id", None),
    )
    try:
        config = spec.draft_config(target_like)
    except ValueError as exc:
        raise ValueError(f"{where}: aux_hidden_state_layer_ids {raw['aux_hidden_state_layer_ids']}: {exc}") from None
    config.attention_bias = bool(getattr(tl, "attention_bias", False))  # the peer's attention reads both
    config.hidden_act = getattr(tl, "hidden_act", "silu")
    out = export_config(config)
    if not num_target_layers:
        out.pop("num_target_layers")  # unknown: not guessed
    out.update({k: carried[k] for k in OUR_KEYS if k != "num_target_layers" and carried.get(k) is not None})
    out["dtype"] = raw.get("dtype") or "float32"
    return out


def _read_tensors(folder: Path) -> dict:
    """The folder's safetensors (one file or an index of shards); pickled checkpoints are refused."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in load_file(str(folder / f)).items()}
    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    raise FileNotFoundError(f"{folder}: no model.safetensors (pickled checkpoints are not read)")


def from_speculators(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """(our config.json dict, tensors) of the peer's drafter folder, the tensors the peer rebuilds from the verifier
    left out. Refused, naming the file and every field, where the drafter cannot cross (`crossing_problems`)."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    raw = json.loads(cfg_file.read_text())
    config = our_config(raw, where=str(cfg_file))
    state = {k: v for k, v in _read_tensors(folder).items() if k not in VERIFIER_OWNED}
    return config, state
