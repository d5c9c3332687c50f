"""A capture job from plain settings: load prompts, open the store with its provenance, estimate size."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from flashdraft.prompts import DEFAULT_HELDOUT_FRACTION, check_limit, load_prompts
from flashdraft.store import StoreLayout, StoreWriter, bytes_per_token, files_per_shard
from flashdraft.store.projection import split_store_options
from flashdraft.target import chat_input_ids, chat_template_hash, load_config, load_tokenizer, target_fingerprint
from pipeline.settings import CaptureSettings


def load_records(
    sources,
    *,
    split: str | None = "train",
    limit: int | Mapping | None = None,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    counts: dict | None = None,
):
    """Records of every source and the rejects found while reading them. A conversation met twice, in one source or
    across them, is kept once; the others are rejects (`duplicate of <seq_id>`).

    `limit` caps each source: one number for all, or a mapping from source to its cap (sources it does not
    name are not capped). `counts`, where given, gets "read" (records read: kept, rejected, or outside the split)
    and "outside split" (records of the split not asked for), so that every record read is accounted for.
    """
    records, rejects, seen, outside = [], [], {}, []
    for source in sources:
        found = []
        cap = source_limit(sources, limit, source)
        records += load_prompts(
            str(source),
            split=split,
            limit=cap,
            heldout_fraction=heldout_fraction,
            rejects=found,
            seen=seen,
            outside_split=outside,
        )
        rejects += [
            {"seq_id": None, "source": r.source, "record_id": r.record_id, "reason": r.reason, "raw": r.raw}
            for r in found
        ]
    if counts is not None:
        counts.update({"read": len(records) + len(rejects) + len(outside), "outside split": len(outside)})
    return records, rejects


def source_limit(sources, limit: int | Mapping | None, source) -> int | None:
    """The cap `limit` (one number for all, or a mapping from source to its cap) puts on `source`."""
    if isinstance(limit, Mapping):
        unknown = sorted(set(map(str, limit)) - set(map(str, sources)))
        if unknown:
            raise ValueError(f"data.limit names sources that data.sources does not list: {unknown}")
        return check_limit(limit.get(str(source)), f"data.limit.{source}")
    return check_limit(limit, "data.limit")


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
    layout, projection = split_store_options(store_options, settings.layer_ids, config.hidden_size)
    if projection is not None:  # what to fit; the driver fits it before the first task (`pipeline.fleet`)
        from flashdraft.store import is_store, read_manifest

        if is_store(store_path) and (read_manifest(store_path).get("projection") or {}).get("sha256"):
            projection = None  # a resumed capture keeps the basis the store holds
        else:
            extra["projection"] = {**projection, "sha256": None}
    return StoreWriter(
        store_path, layer_ids=settings.layer_ids, hidden_size=config.hidden_size, manifest_extra=extra, **layout
    )


def mean_prompt_tokens(records, settings: CaptureSettings, sample: int = 256) -> float:
    """Mean rendered prompt length over a sample of `records` (about 4 characters a token where the tokenizer
    cannot be loaded)."""
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
                tokenizer, msgs, enable_thinking=settings.thinking_for(r.seq_id), system_prompt=settings.system_prompt
            )
            lens.append(len(ids))
    return sum(lens) / max(1, len(lens))


def sampled_row(source: str, records, settings: CaptureSettings, expected_response_tokens=None) -> dict:
    """A source whose records load: its prompts counted, their lengths measured on a sample; the response is
    `expected_response_tokens` (default half of max_new_tokens)."""
    response = expected_response_tokens if expected_response_tokens is not None else settings.max_new_tokens / 2
    return {
        "source": source,
        "prompts": len(records),
        "prompt_tokens": mean_prompt_tokens(records, settings),
        "response_tokens": float(response),
        "origin": f"sampled from its {len(records)} records",
    }


def figures_row(
    source: str, figures, *, split, heldout_fraction: float, cap, max_new_tokens: int, expected_response_tokens=None
) -> dict:
    """A source taken at its recorded figures (`SourceFigures`): its samples, the `split`'s share of them
    (the split is a hash of each record, so the share is expected, not exact), capped by `cap`."""
    share = {"train": 1 - heldout_fraction, "heldout": heldout_fraction}.get(split, 1.0)
    prompts = int(round(int(figures.samples) * share))
    if cap is not None:
        prompts = min(prompts, int(cap))
    response = expected_response_tokens if expected_response_tokens is not None else figures.response_tokens
    return {
        "source": source,
        "prompts": prompts,
        "prompt_tokens": float(figures.prompt_tokens),
        "response_tokens": float(min(response, max_new_tokens)),
        "origin": f"data.figures: {figures.source}",
    }


def estimate(
    rows: list[dict],
    layout: StoreLayout,
    *,
    max_length: int,
    shard_size: int,
    capture_tokens_per_s: float,
    store_path,
) -> dict:
    """Bytes on disk, shards, files and GPU-hours of a capture of `rows` (`sampled_row` / `figures_row`) in
    `layout`, and in bf16 and fp8 beside it, raw and projected to r = H, 2H, 2.5H (`projected`, keyed (label, r,
    dtype)): prompts x (prompt + response, at most max_length) tokens x bytes a token. Compression is not counted
    (half-precision features barely compress), so bytes are an upper bound."""
    prompts = sum(r["prompts"] for r in rows)
    tokens = sum(int(r["prompts"] * min(max_length, r["prompt_tokens"] + r["response_tokens"])) for r in rows)
    shards = -(-prompts // shard_size)
    shard_tokens = tokens / max(1, prompts) * shard_size  # a full shard's rows
    by_dtype = {}
    for dtype in dict.fromkeys((layout.dtype, "bfloat16", "float8_e4m3")):
        lay = replace(layout, dtype=dtype)
        by_dtype[dtype] = {
            "bytes_per_token": bytes_per_token(len(lay.layer_ids), lay.hidden_size, dtype, lay.teacher_topk),
            "files_per_shard": files_per_shard(lay),
            "arrays": len(lay.array_keys()),
            "files": shards * files_per_shard(lay),
        }
        by_dtype[dtype]["bytes"] = tokens * by_dtype[dtype]["bytes_per_token"]
    projected = {}  # the features projected (data.store.project=pca) to r = H, 2H, 2.5H, in bf16 and fp8
    H, L = layout.hidden_size, len(layout.layer_ids)
    for label, r in {"H": H, "2H": 2 * H, "2.5H": round(2.5 * H), **_own_dims(layout)}.items():
        if not 0 < r < L * H:
            continue
        for dtype in ("bfloat16", "float8_e4m3"):
            b = bytes_per_token(L, H, dtype, layout.teacher_topk, project_dims=r)
            projected[(label, r, dtype)] = {"bytes_per_token": b, "bytes": tokens * b}
    path = Path(store_path)
    while not path.exists():
        path = path.parent
    free = shutil.disk_usage(path).free
    own_bytes = tokens * bytes_per_token(L, H, layout.dtype, layout.teacher_topk, project_dims=layout.project_dims)
    return {
        "prompts": prompts,
        "mean_prompt_tokens": sum(r["prompts"] * r["prompt_tokens"] for r in rows) / max(1, prompts),
        "mean_response_tokens": sum(r["prompts"] * r["response_tokens"] for r in rows) / max(1, prompts),
        "tokens": tokens,
        "shards": shards,
        "shard_tokens": int(shard_tokens),
        "by_dtype": by_dtype,
        "projected": projected,
        "gpu_hours": tokens / capture_tokens_per_s / 3600,
        "free_bytes": free,
        "fits": own_bytes < free,
    }


def _own_dims(layout: StoreLayout) -> dict:
    """The layout's own projection, if any and not one of H, 2H, 2.5H, as a row of `estimate`'s projected table."""
    r, H = layout.project_dims, layout.hidden_size
    return {str(r): r} if r and r not in (H, 2 * H, round(2.5 * H)) else {}
