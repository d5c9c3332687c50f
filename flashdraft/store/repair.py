"""Repairing a store whose manifest lists a shard that cannot be read back: missing on disk (lost to a power loss,
deleted by hand), or damaged inside (an array's zarr.json garbled, a data file truncated, a bad inner chunk).

Each listed shard is checked as `verify` checks it (flashdraft.store.verify: attributes, every array's index and
every inner chunk). The repair drops the entries of the shards that fail (and their rejects from the rejects file)
and changes nothing else; the prompts of a dropped shard are then no longer committed, so the same capture command
run again captures exactly them. A dropped shard's folder, where there is one, is moved out of `shards/` into
`damaged/` (named in the output), not deleted: a repair never destroys captured bytes (the damage may be worth a
look: a failing disk, a tool that wrote into the store), and out of `shards/` the next capture can neither adopt it
again nor write over it. Delete `damaged/` once it has served. The repair holds the writer lock: no capture runs
meanwhile.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flashdraft.durable import fsync_dir
from flashdraft.store.files import (
    damaged_dir,
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
from flashdraft.store.verify import listed_shard_problems


def damaged_shards(store_path: Path, manifest: dict, progress: bool = False) -> list[dict]:
    """The entries of the listed shards that are missing, unreadable or damaged, each with a "why": the problems
    `verify` finds in it (every inner chunk read; a shard that cannot be opened: why not)."""
    found = []
    for entry, problems in listed_shard_problems(store_path, manifest, progress):
        if not problems:
            continue
        try:
            read_shard_attrs(shard_dir(store_path, entry["name"]))
        except StoreError as e:
            found.append({**entry, "why": missing_shard_reason(store_path, entry["name"], e)})
        else:
            found.append({**entry, "why": "; ".join(problems)})
    return found


def move_aside(store_path: Path, name: str) -> Path | None:
    """Move the folder of shard `name`, if it has one, into `damaged/` (a fresh name if an earlier repair left one
    of that name); returns where it went."""
    src = shard_dir(store_path, name)
    if not src.exists():
        return None
    aside = damaged_dir(store_path)
    aside.mkdir(exist_ok=True)
    dst, n = aside / name, 1
    while dst.exists():
        dst, n = aside / f"{name}.{n}", n + 1
    shutil.move(str(src), str(dst))
    fsync_dir(src.parent)
    fsync_dir(aside)
    return dst


def drop_damaged_shards(store_path: str | Path, progress: bool = False) -> list[dict]:
    """Drop every listed shard that is missing, unreadable or damaged from the manifest, moving its folder into
    `damaged/`; returns their entries, each with a "why" (what the check found) and "moved_to" (the folder's new
    place, or None). A store with none is left untouched."""
    store_path = Path(store_path)
    read_manifest(store_path)  # refuses a folder that is not a store before the locks create anything in it
    with writer_lock(store_path):
        dropped = damaged_shards(store_path, read_manifest(store_path), progress)
        if not dropped:
            return []
        # moved first: a crash before the manifest is written leaves them listed and missing (the repair run again
        # drops them), never unlisted inside shards/, where a capture would adopt a complete one again
        for entry in dropped:
            entry["moved_to"] = move_aside(store_path, entry["name"])
        names = {e["name"] for e in dropped}
        with manifest_lock(store_path):
            manifest = read_manifest(store_path)
            kept = [e for e in manifest["shards"] if e["name"] not in names]
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
