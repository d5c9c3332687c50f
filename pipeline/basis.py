"""A projected store's basis in a capture (`flashdraft.store.projection`): fitted once, by the driver through one
worker, before any task is dispatched; then read by every worker, which applies it on its device.

The driver (`fit_store_projection`) asks a worker for the basis when the store's manifest wants one and records its
sha256; the worker fits it on the target's features of the first calibration tokens of the capture's prompts
(`calibration_features`: their prompts, or in capture mode their whole sequences) and writes it into the store. Every
worker reads that one basis, checked against the sha256 recorded, when it opens a task (`store_basis`).
"""

from __future__ import annotations

import sys

import torch

from flashdraft.store import StoreWriter, read_manifest
from flashdraft.store.projection import DEFAULT_CALIBRATION_TOKENS, calibration_prefix, load_projection
from pipeline.capture import capture, token_batches
from pipeline.encode import Conversation, PromptEncoder


def store_basis(store_path: str, dims: int, device: torch.device):
    """The store's basis of `dims` dimensions (its file's sha256 checked against the manifest), on `device`."""
    proj = load_projection(store_path)
    if proj is None or proj.dims != dims:
        raise RuntimeError(f"{store_path}: no projection basis of {dims} dims")
    return proj.to(device)


def calibration_features(
    model, encoder: PromptEncoder, records, tokens: int, layer_ids: list[int], prefill_tokens: int | None
) -> list[torch.Tensor]:
    """The raw features of the first `tokens` tokens of `records` that encode (their prompts, or in capture mode their
    whole sequences), on the target's device: one prefill a `prefill_tokens` group."""
    encoded = (encoder.encode(rec) for rec in records)
    seqs = calibration_prefix(
        (e.ids if isinstance(e, Conversation) else e[0] for e in encoded if not isinstance(e, str)), tokens
    )
    if not seqs:
        raise RuntimeError("no prompt of the capture encodes: nothing to fit the store's projection on")
    device = next(model.parameters()).device
    feats = []
    for group in token_batches([len(x) for x in seqs], prefill_tokens):
        group_seqs = [seqs[i] for i in group]
        masks = [[False] * len(x) for x in group_seqs]
        out = capture(model, group_seqs, masks, layer_ids, pad_id=encoder.pad_id)
        feats += [c.features.to(device) for c in out]
    return feats


def projection_to_fit(writer: StoreWriter) -> dict | None:
    """The manifest's `projection` entry when the store is projected and its basis is not fitted yet; else None."""
    writer.manifest = read_manifest(writer.path)
    entry = writer.manifest.get("projection")
    if not writer.layout.project_dims or (entry and entry.get("sha256")):
        return None
    return entry or {"method": "pca", "calibration_tokens": DEFAULT_CALIBRATION_TOKENS}


def fit_store_projection(writer: StoreWriter, fit, records) -> None:
    """Fit a projected store's basis once, before any task is dispatched: `fit(records, tokens, method)` (a worker's
    `fit_projection`, in-process or on actor 0) writes it into the store; the driver records its sha256 in the
    manifest, and every worker reads that one basis (checked against it) when it opens a task."""
    entry = projection_to_fit(writer)
    if entry is None:
        return
    tokens = int(entry["calibration_tokens"])
    # the first prompts, enough of them for the calibration tokens (a worker takes them in order until it has those)
    first = list(records[: max(1024, tokens // 8)])
    got = fit(first, tokens, entry.get("method", "pca"))
    writer.update(projection={**entry, **got})
    print(f"projection basis {got['sha256'][:12]} recorded in {writer.path}", file=sys.stderr, flush=True)
