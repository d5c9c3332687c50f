"""A capture job from plain settings: load prompts, open the store with its provenance, estimate size."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from flashdraft.prompts import load_prompts
from flashdraft.store import StoreWriter, bytes_per_token
from flashdraft.target import chat_input_ids, chat_template_hash, load_config, load_tokenizer, target_fingerprint
from pipeline.worker import CaptureSettings


def load_records(
    sources, *, split: str | None = "train", limit: int | Mapping | None = None, heldout_fraction: float = 0.2
):
    """Records of every source and the rejects found while reading them.

    `limit` caps each source: one number for all, or a mapping from source to its cap (sources it does not
    name are not capped).
    """
    if isinstance(limit, Mapping):
        unknown = sorted(set(map(str, limit)) - set(map(str, sources)))
        if unknown:
            raise ValueError(f"data.limit names sources that data.sources does not list: {unknown}")
    records, rejects = [], []
    for source in sources:
        found = []
        cap = limit.get(str(source)) if isinstance(limit, Mapping) else limit
        records += load_prompts(str(source), split=split, limit=cap, heldout_fraction=heldout_fraction, rejects=found)
        rejects += [
            {"seq_id": None, "source": r.source, "record_id": r.record_id, "reason": r.reason, "raw": r.raw}
            for r in found
        ]
    return records, rejects


def target_config(target: str, trust_remote_code: bool = False):
    return load_config(target, trust_remote_code)


def open_store(store_path, settings: CaptureSettings, *, sources, store_options: dict) -> StoreWriter:
    """Create the store (or reopen it to resume; it must hold the same capture) with full provenance. The mask
    token is not part of it: the trainer chooses it when it makes the drafter's spec."""
    config = target_config(settings.target, settings.trust_remote_code)
    tokenizer = load_tokenizer(settings.target, settings.trust_remote_code)
    extra = {
        "target": target_fingerprint(settings.target),
        "chat_template_sha256": chat_template_hash(tokenizer),
        "vocab_size": int(config.vocab_size),
        "generation": settings.identity(),
        "sources": [str(s) for s in sources],
    }
    return StoreWriter(
        store_path, layer_ids=settings.layer_ids, hidden_size=config.hidden_size, manifest_extra=extra, **store_options
    )


def estimate(
    records,
    settings: CaptureSettings,
    *,
    hidden_size: int,
    dtype: str,
    store_path,
    expected_response_tokens: int | None = None,
    sample: int = 256,
    teacher_topk: int = 0,
) -> dict:
    """Bytes on disk before capture: prompts x expected length x layers x hidden x bytes/element.

    Prompt lengths are measured on a sample of rendered prompts (about 4 characters a token where
    the tokenizer cannot be loaded); the response length is `expected_response_tokens` (default half of
    max_new_tokens). Compression is not counted (half-precision features barely compress), so the figure is an
    upper bound.
    """
    try:
        tokenizer = load_tokenizer(settings.target, settings.trust_remote_code)
    except OSError:
        tokenizer = None
    step = max(1, len(records) // sample)
    lens = []
    for r in records[::step][:sample]:
        msgs = [m for m in r.messages if m["role"] != "assistant"] or list(r.messages)
        if tokenizer is None:
            lens.append(sum(len(m["content"]) for m in msgs) / 4 + 8 * len(msgs))
        else:
            ids = chat_input_ids(
                tokenizer, msgs, enable_thinking=settings.enable_thinking, system_prompt=settings.system_prompt
            )
            lens.append(len(ids))
    prompt = sum(lens) / max(1, len(lens))
    response = expected_response_tokens if expected_response_tokens is not None else settings.max_new_tokens / 2
    per_seq = min(settings.max_length, prompt + response)
    tokens = int(len(records) * per_seq)
    bpt = bytes_per_token(len(settings.layer_ids), hidden_size, dtype, teacher_topk)
    path = Path(store_path)
    while not path.exists():
        path = path.parent
    free = shutil.disk_usage(path).free
    return {
        "prompts": len(records),
        "mean_prompt_tokens": round(prompt, 1),
        "expected_response_tokens": response,
        "tokens": tokens,
        "bytes_per_token": bpt,
        "bytes": tokens * bpt,
        "free_bytes": free,
        "fits": tokens * bpt < free,
    }
