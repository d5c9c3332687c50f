"""Rewrite a store of raw features in another dtype and/or projected (`python -m pipeline transcode`).

One captured store then serves every setting of a comparison (bf16, fp8, projected r = H, 2H, ... in either): the
copy holds the same sequences, shard by shard under the same names, with the same provenance (target, template,
generation settings) and a `transcoded_from` entry. A projected copy's basis is fitted on the source's first
`calibration_tokens` tokens (as a capture fits it on its first ones), or taken from another projected store
(`basis`: its file copied byte for byte, so both stores name the same sha256 and train together).

Refused by name: a source that is already projected (its layers cannot be recovered) and a replay store (the eval
prompts' store, `features-heldout`: served-order replay reads its raw features with the exported drafter), except
with `basis`: a copy projected by a training store's basis is the trainer's eval store for a drafter trained on that
basis (`train.eval_stores`: mixed kinds are refused), while the replay keeps reading the raw original.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, replace
from pathlib import Path

import torch

from flashdraft.store.files import REJECTS, is_store, listed_shard_attrs, read_manifest
from flashdraft.store.format import StoreError
from flashdraft.store.projection import (
    PROJECTION_FILE,
    fit_projection,
    load_projection,
    resolve_dims,
    save_projection,
)
from flashdraft.store.reader import StoreReader
from flashdraft.store.writer import ShardWriter, StoreWriter

PROVENANCE = ("target", "chat_template_sha256", "vocab_size", "generation", "sources")
REPLAY_STORE_NAMES = ("features-heldout",)  # conf/config.yaml eval.replay_store, the held-out capture's folder


def is_replay_store(path, manifest: dict) -> bool:
    """The eval prompts' store (the served-order replay's): its folder name, or its recorded split."""
    return Path(path).name in REPLAY_STORE_NAMES or manifest.get("split") == "heldout"


def calibration_features(reader: StoreReader, tokens: int) -> torch.Tensor:
    """The raw features of the store's first `tokens` tokens, in store order (the last sequence cut)."""
    parts, n = [], 0
    for i in range(len(reader)):
        f = reader.read(i).features
        parts.append(f[: tokens - n])
        n += len(parts[-1])
        if n >= tokens:
            break
    return torch.cat(parts)


def transcode(
    src,
    dst,
    *,
    dtype: str | None = None,
    project: str | None = None,
    project_dims="2H",
    calibration_tokens: int = 32768,
    basis=None,
    progress: bool = True,
) -> dict:
    """Write `dst`, a copy of store `src` in `dtype` (default: src's), projected by a basis fitted on src
    (`project`='pca', `project_dims`) or by `basis` (another projected store's); returns dst's manifest."""
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    manifest = read_manifest(src)
    if manifest.get("layout", {}).get("project_dims") or manifest.get("projection"):
        raise StoreError(f"{src} is already a projected store: its layers cannot be recovered; transcode a raw store")
    if is_replay_store(src, manifest) and basis is None:
        raise StoreError(
            f"{src} is a replay store (the eval prompts' store): served-order replay reads its raw features with the "
            "exported drafter, which reads raw features whatever store it was trained on; keep it as it is. Only an "
            "eval copy for a drafter trained on a projected store is made of it: basis=THAT_STORE"
        )
    if is_store(dst) or (dst.exists() and any(dst.iterdir())):
        raise StoreError(f"{dst} exists and is not empty: transcode writes a new store")
    reader = StoreReader(src)
    layout = reader.layout
    L, H = len(layout.layer_ids), layout.hidden_size
    proj = None
    if basis is not None:
        bmanifest = read_manifest(basis)
        proj = load_projection(basis, bmanifest)
        if proj is None:
            raise StoreError(f"basis={basis} is not a projected store: it holds no basis")
        if proj.input_dims != L * H or list(bmanifest["layer_ids"]) != list(layout.layer_ids):
            raise StoreError(
                f"basis={basis} projects layers {bmanifest['layer_ids']} x {bmanifest['hidden_size']}, {src} holds "
                f"{list(layout.layer_ids)} x {H}"
            )
    elif project is not None:
        if project != "pca":
            raise StoreError(f"project must be pca, got {project!r}")
        dims = resolve_dims(project_dims, H, L * H)
        proj = fit_projection(calibration_features(reader, int(calibration_tokens)), dims)
    new_layout = replace(layout, dtype=dtype or layout.dtype, project_dims=proj.dims if proj is not None else 0)
    extra = {k: manifest.get(k) for k in PROVENANCE if k in manifest}
    extra["transcoded_from"] = {"path": str(src.resolve()), "dtype": layout.dtype, "tokens": manifest["counts"]}
    writer = StoreWriter(dst, manifest_extra=extra, **asdict(new_layout))  # every layout field, as the source's
    if proj is not None:
        if basis is not None:  # the same bytes, so the same sha256: stores of one basis train together
            shutil.copyfile(Path(basis) / PROJECTION_FILE, dst / PROJECTION_FILE)
            entry = {**read_manifest(basis)["projection"], "basis_from": str(Path(basis).resolve())}
        else:
            entry = save_projection(dst, proj, layer_ids=list(layout.layer_ids), hidden_size=H)
        writer.update(projection=entry)
        proj = load_projection(dst)  # what the store now holds, checked
    topk = bool(layout.teacher_topk)
    i = 0
    for entry in tqdm(manifest["shards"], desc="transcode", unit="shard", disable=not progress):
        attrs = listed_shard_attrs(src, entry["name"])
        thinking = attrs.get("thinking") or [None] * len(attrs["seq_ids"])
        with ShardWriter(dst, entry["name"], new_layout) as shard:
            for j, seq_id in enumerate(attrs["seq_ids"]):
                assert reader.seq_ids[i] == seq_id
                seq = reader.read(i, teacher=topk)
                feats = seq.features if proj is None else seq.features @ proj.projection
                teacher = (seq.teacher_ids, seq.teacher_logp) if topk else None
                shard.append(seq_id, seq.input_ids, seq.loss_mask, feats, teacher, thinking[j])
                i += 1
            for r in attrs.get("rejects", []):
                shard.reject(**r)
            for note in attrs.get("notes", []):
                shard.note(
                    note["seq_id"], note["note"], **{k: v for k, v in note.items() if k not in ("seq_id", "note")}
                )
        writer.register(shard.info())
    if (src / REJECTS).is_file():
        shutil.copyfile(src / REJECTS, dst / REJECTS)
    return read_manifest(dst)
