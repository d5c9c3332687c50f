"""Repairing a store whose manifest lists a shard that is not on disk (lost to a power loss, deleted by hand).

The repair drops such entries from the manifest (and their rejects from the rejects file) and changes nothing
else; the prompts of a dropped shard are then no longer committed, so the same capture command run again captures
exactly them. It holds the writer lock: no capture runs meanwhile.
"""

from __future__ import annotations

from pathlib import Path

from flashdraft.store.files import (
    manifest_lock,
    missing_shard_reason,
    now,
    read_manifest,
    read_rejects,
    read_shard_attrs,
    shard_dir,
    write_manifest,
    write_rejects,
)
from flashdraft.store.format import StoreError
from flashdraft.store.lock import writer_lock


def drop_missing_shards(store_path: str | Path) -> list[dict]:
    """Drop every listed shard that is missing or unreadable on disk from the manifest; returns their entries,
    each with a "why" (the error that refused it). A store with none is left untouched."""
    store_path = Path(store_path)
    read_manifest(store_path)  # refuses a folder that is not a store before the locks create anything in it
    with writer_lock(store_path), manifest_lock(store_path):
        manifest = read_manifest(store_path)
        kept, dropped = [], []
        for entry in manifest["shards"]:
            try:
                read_shard_attrs(shard_dir(store_path, entry["name"]))
            except StoreError as e:
                dropped.append({**entry, "why": missing_shard_reason(store_path, entry["name"], e)})
            else:
                kept.append(entry)
        if not dropped:
            return []
        manifest["shards"] = kept
        manifest["counts"] = {
            key: sum(e.get(key, 0) for e in kept) for key in ("sequences", "tokens", "response_tokens")
        }
        manifest["updated"] = now()
        write_manifest(store_path, manifest)
        gone = {(r.get("seq_id"), r.get("reason")) for e in dropped for r in e.get("rejects", [])}
        rejects = read_rejects(store_path)
        write_rejects(store_path, [r for r in rejects if (r.get("seq_id"), r.get("reason")) not in gone])
    return dropped
