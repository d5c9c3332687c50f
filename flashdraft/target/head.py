"""The target's input embedding and output head, frozen, without the rest of the target: enough to train and
run a drafter. Read from a loaded model (shared) or straight from the checkpoint's safetensors (two tensors)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flashdraft.target.family import family_of
from flashdraft.target.load import load_config, resolve_target


@dataclass
class FrozenHead:
    """The target's input embedding and output head, frozen; enough to train and run a drafter."""

    embed: nn.Embedding
    lm_head: nn.Linear
    embed_scale: float = 1.0

    def to(self, *args, **kwargs) -> FrozenHead:
        self.embed.to(*args, **kwargs)
        self.lm_head.to(*args, **kwargs)
        return self

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) * self.embed_scale


def frozen_head_from_model(model) -> FrozenHead:
    """Share (not copy) the loaded target's embedding and head."""
    head = getattr(model, "lm_head", None) or model.get_output_embeddings()
    return FrozenHead(model.get_input_embeddings(), head)


def _target_folder_and_weights(name_or_path: str) -> tuple[Path, dict]:
    """(folder, tensor name -> safetensors file) of a target, without loading any tensor."""
    folder = Path(resolve_target(name_or_path))
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"]))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return folder, json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors or index")
    with safe_open(str(single), "pt") as f:
        return folder, {k: "model.safetensors" for k in f.keys()}


def read_target_tensors(name_or_path: str, names, dtype: torch.dtype = torch.float32) -> dict:
    """Tensors of a target's checkpoint, read one by one: `names` is a list (absent names are left
    out) or a predicate on the checkpoint's tensor names."""
    folder, weight_map = _target_folder_and_weights(name_or_path)
    if callable(names):
        names = [n for n in weight_map if names(n)]
    by_file = {}
    for name in names:
        if name in weight_map:
            by_file.setdefault(weight_map[name], []).append(name)
    out = {}
    for file, wanted in by_file.items():  # each shard opened once
        with safe_open(str(folder / file), "pt") as f:
            out.update((name, f.get_tensor(name).to(dtype)) for name in wanted)
    return {name: out[name] for name in names if name in out}


def load_frozen_head(name_or_path: str, dtype: torch.dtype = torch.float32) -> FrozenHead:
    """Read only the embedding and output-head tensors from a target folder's safetensors."""
    folder, weight_map = _target_folder_and_weights(name_or_path)
    family = family_of(load_config(str(folder)))

    def read(keys):
        found = read_target_tensors(name_or_path, [k for k in keys if k in weight_map][:1], dtype)
        return next(iter(found.values()), None)

    embed_w = read(family.embed_keys())
    if embed_w is None:
        raise KeyError(f"{folder}: no input embedding among {list(family.embed_keys())} ({family.name} family)")
    head_w = read((family.head_key,))
    config = json.loads((folder / "config.json").read_text())
    if head_w is None:
        if not config.get("tie_word_embeddings", True):
            raise KeyError(f"{folder}: no {family.head_key} and embeddings are not tied")
        head_w = embed_w
    embed = nn.Embedding.from_pretrained(embed_w, freeze=True)
    lm_head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False)
    lm_head.weight = nn.Parameter(head_w, requires_grad=False)
    return FrozenHead(embed, lm_head)
