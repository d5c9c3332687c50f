"""Writing a store: one `ShardWriter` per fleet task, one `StoreWriter` that keeps the manifest.

A shard is written under a temporary name, flushed, fsynced, renamed and its folder fsynced (the rename durable);
only then is it listed in the manifest, whose replace is fsynced the same way.
A reader sees only listed shards, so a crashed writer leaves nothing a reader can trip on. Two writers touching
the same chunk lose writes, so each writer owns whole shards.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from flashdraft.durable import fsync_dir, fsync_tree
from flashdraft.store.files import (
    array_file,
    dir_bytes,
    is_store,
    is_temp,
    manifest_lock,
    now,
    part_file,
    read_manifest,
    read_shard_attrs,
    shard_dir,
    shard_exists,
    shard_is_complete,
    shard_name,
    shard_seq_ids,
    shards_dir,
    stale_temp_files,
    temp_shard_dir,
    write_manifest,
)
from flashdraft.store.format import (
    FEATURE_SCALES,
    FEATURES,
    FORMAT_VERSION,
    StoreError,
    StoreLayout,
    encode_features,
    encode_index,
    mask_runs,
)
from flashdraft.store.reader import StoreReader
from flashdraft.store.space import naming_disk_full

# Manifest keys that must agree between a store and a writer that appends to it. The mask token is not one of
# them: no feature depends on it (stores written when it was are still opened).
_IDENTITY_KEYS = (
    "layer_ids",
    "hidden_size",
    "dtype",
    "layout",
    "target",
    "chat_template_sha256",
    "vocab_size",
    "generation",
)


class _Here:
    """An executor's `map`, run in the calling thread."""

    map = map


class ShardWriter:
    """Writes one shard: appends are buffered to `shard_tokens` rows, then encoded as inner chunks of
    `chunk_tokens` rows and streamed to one data file per array; commit appends each file's shard index, writes
    the arrays' zarr.json and renames the shard into place. Host memory: one write block, whatever the shard size.

    Use as a context manager: a clean exit commits, an exception aborts (deletes the temp dir). A failed write or
    commit deletes the temp dir too, whoever called it; a full disk raises DiskFullError naming the shard.
    """

    def __init__(self, store_path: str | Path, name: str, layout: StoreLayout, pool=None):
        """`pool`: an executor (concurrent.futures) that encodes a write block's inner chunks in parallel; None: here,
        one after the other."""
        import zarr

        self.layout, self.name, self.pool = layout, name, pool
        self.final = shard_dir(store_path, name)
        if self.final.exists():
            raise StoreError(f"shard {self.final} already exists")
        self.tmp = temp_shard_dir(store_path, name)
        self.parts = {}
        try:
            with naming_disk_full(self.final):
                self.tmp.mkdir(parents=True)
                self.group = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
                self.parts = self._open_parts()
        except BaseException:
            self.abort()
            raise
        self.buffers = {k: [] for k in self.parts}
        self.buffered = 0
        self.written = 0
        self.seq_ids: list[str] = []
        self._seen: set[str] = set()
        self.rejects: list[dict] = []  # inputs this shard was given and refused, kept with the shard
        self.notes: list[dict] = []  # what a stored sequence's record should know (a conversation cut short)
        self.offsets = [0]
        self.response_spans: list[list[int]] = []  # per sequence: [start, end, ...] of its loss-mask runs
        self.thinking: list[bool | None] = []  # per sequence: the enable_thinking it was rendered with (None: unset)
        self.response_tokens = 0
        self.closed = False

    def _open_parts(self) -> dict:
        """Per array, its data file being streamed: [file, (offset, nbytes) of each inner chunk written]."""
        for key in self.layout.array_keys():  # one at a time, so that abort closes those opened when one fails
            self.parts[key] = [open(part_file(self.tmp, key), "wb"), []]
        return self.parts

    def _write_chunks(self, key: str, data: np.ndarray, final: bool) -> None:
        """Encode `data` (whole inner chunks; when final, the last one padded with zeros) to the array's file."""
        f, entries = self.parts[key]
        ct = self.layout.chunk_tokens
        if final and len(data) % ct:
            pad = np.zeros((ct - len(data) % ct, *data.shape[1:]), dtype=data.dtype)
            data = np.concatenate([data, pad])
        blocks = (data[a : a + ct] for a in range(0, len(data), ct))
        for blob in (self.pool or _Here).map(self.layout.encode_chunk, blocks):
            entries.append((f.tell(), len(blob)))
            f.write(blob)

    def _finish_arrays(self) -> None:
        """Append each array's shard index, write its zarr.json and move its data file into place."""
        lay, T = self.layout, self.written
        ct = lay.chunk_tokens
        n_inner = max(1, -(-T // ct))
        for key, (dtype, row) in lay.array_specs().items():
            f, entries = self.parts[key]
            if T:
                f.write(encode_index(np.asarray(entries, dtype=np.uint64).reshape(n_inner, 2)))
            f.close()
            self.group.create_array(
                key,
                shape=(T, *row),
                dtype=dtype,
                chunks=(ct, *row),
                shards=(n_inner * ct, *row),
                compressors=lay.compressors(np.dtype(dtype).itemsize),
                fill_value=0,
                chunk_key_encoding={"name": "v2", "separator": "."},
            )
            if T:
                os.replace(part_file(self.tmp, key), array_file(self.tmp, key, 1 + len(row)))
            else:
                os.remove(part_file(self.tmp, key))

    def append(self, seq_id: str, input_ids, loss_mask, features, teacher=None, thinking: bool | None = None) -> None:
        """teacher: (ids [S, k], log-probs [S, k]) when the layout keeps the target's top-k, else None; thinking: the
        chat template's enable_thinking the sequence was rendered with (None: not set, not a thinking model)."""
        if self.closed:
            raise StoreError(f"shard {self.name} is already closed")
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        mask = np.asarray(loss_mask, dtype=bool).reshape(-1)
        feats = torch.as_tensor(features)
        teacher = self._check(seq_id, ids, mask, feats, teacher)
        rows = {"input_ids": ids.astype(np.int32), "loss_mask": mask}
        rows[FEATURES], scale = encode_features(feats, self.layout.scale_groups, self.layout.dtype)
        if scale is not None:
            rows[FEATURE_SCALES] = scale
        if teacher is not None:
            rows["teacher_ids"] = teacher[0].to(torch.int32).numpy()
            rows["teacher_logp"] = teacher[1].to(torch.float16).numpy()
        self._add(str(seq_id), rows, thinking)

    def append_stored(self, seq_id: str, rows: dict, thinking: bool | None = None) -> None:
        """Append a sequence given as its rows of every array, already in the stored dtypes (a converter's copy)."""
        if self.closed:
            raise StoreError(f"shard {self.name} is already closed")
        specs = self.layout.array_specs()
        if set(rows) != set(specs) or len({len(r) for r in rows.values()}) != 1 or seq_id in self._seen:
            raise StoreError(f"sequence {seq_id!r}: rows {sorted(rows)} do not fit this layout ({sorted(specs)})")
        self._add(str(seq_id), {k: np.asarray(r, dtype=specs[k][0]) for k, r in rows.items()}, thinking)

    def _add(self, seq_id: str, rows: dict, thinking: bool | None = None) -> None:
        self._seen.add(seq_id)
        self.thinking.append(None if thinking is None else bool(thinking))
        for k, r in rows.items():
            self.buffers[k].append(r)
        S = len(rows["input_ids"])
        self.seq_ids.append(seq_id)
        self.offsets.append(self.offsets[-1] + S)
        self.response_spans.append(mask_runs(rows["loss_mask"]))
        self.response_tokens += int(rows["loss_mask"].sum())
        self.buffered += S
        if self.buffered >= self.layout.shard_tokens:
            try:
                with naming_disk_full(self.final):
                    self._flush(final=False)
            except BaseException:  # the data files are cut short: nothing of this shard can be committed
                self.abort()
                raise

    def _check(self, seq_id, ids, mask, feats, teacher):
        """Refuse a sequence that does not fit the layout; returns its teacher tensors (None without top-k)."""
        S, n, H = len(ids), len(self.layout.layer_ids), self.layout.hidden_size
        if S == 0:
            raise StoreError(f"sequence {seq_id!r} is empty")
        if mask.shape != (S,) or tuple(feats.shape) != (S, self.layout.feature_dims):
            width = f"{self.layout.project_dims} (projected)" if self.layout.project_dims else f"{n}*{H}"
            raise StoreError(
                f"sequence {seq_id!r}: input_ids [{S}], loss_mask {list(mask.shape)}, features {list(feats.shape)}; "
                f"expected loss_mask [{S}] and features [{S}, {width}]"
            )
        if not torch.isfinite(feats).all():
            raise StoreError(f"sequence {seq_id!r}: features contain NaN or Inf")
        if ids.min() < 0 or ids.max() >= 2**31:
            raise StoreError(f"sequence {seq_id!r}: token ids out of int32 range")
        k = self.layout.teacher_topk
        if k and teacher is None:
            raise StoreError(f"sequence {seq_id!r}: this store keeps the target's top-{k} next tokens, none given")
        if k:
            teacher = tuple(torch.as_tensor(x) for x in teacher)
            if tuple(teacher[0].shape) != (S, k) or tuple(teacher[1].shape) != (S, k):
                raise StoreError(
                    f"sequence {seq_id!r}: teacher ids {list(teacher[0].shape)} / log-probs {list(teacher[1].shape)}, "
                    f"expected [{S}, {k}]"
                )
        if seq_id in self._seen:
            raise StoreError(f"sequence {seq_id!r} appended twice to shard {self.name}")
        return teacher if k else None

    def reject(self, seq_id: str, reason: str, **fields) -> None:
        """Record that `seq_id` belonged to this shard's work but was refused (it counts as done)."""
        self.rejects.append({"seq_id": str(seq_id), "reason": reason, **fields})

    def note(self, seq_id: str, text: str, **fields) -> None:
        """Record something about a stored sequence (it was kept, unlike a reject); shard attrs and info carry the
        notes only when there are some, so shards without any keep their attrs as before."""
        self.notes.append({"seq_id": str(seq_id), "note": text, **fields})

    def _flush(self, final: bool) -> None:
        """Encode whole `shard_tokens` blocks (and, when final, the remainder) and append them to the data files."""
        step = self.layout.shard_tokens
        n = self.buffered if final else (self.buffered // step) * step
        if n == 0:
            return
        for k, parts in self.buffers.items():
            data = np.concatenate(parts) if len(parts) > 1 else parts[0]
            self._write_chunks(k, data[:n], final)
            self.buffers[k] = [data[n:]] if n < len(data) else []
        self.written += n
        self.buffered -= n

    def commit(self) -> dict:
        """Flush, fsync, rename into place; returns the shard's manifest entry."""
        if self.closed:
            raise StoreError(f"shard {self.name} is already closed")
        try:
            with naming_disk_full(self.final):
                self._commit()
        except BaseException:  # a failed write, fsync or rename: the temp dir goes, the shard is not there
            self.abort()
            raise
        self.closed = True
        return self.info()

    def _commit(self) -> None:
        self._flush(final=True)
        self._finish_arrays()
        self.group.attrs.update(
            {
                "format_version": FORMAT_VERSION,
                "seq_ids": self.seq_ids,
                "offsets": self.offsets,
                "response_spans": self.response_spans,
                "sequences": len(self.seq_ids),
                "tokens": self.written,
                "response_tokens": self.response_tokens,
                "rejects": self.rejects,
                "layer_ids": list(self.layout.layer_ids),
                "dtype": self.layout.dtype,
                "complete": True,
                **({"notes": self.notes} if self.notes else {}),
                # only where a mode was set, so that shards of other targets keep their attrs as before
                **({"thinking": self.thinking} if any(t is not None for t in self.thinking) else {}),
            }
        )
        fsync_tree(self.tmp)
        os.rename(self.tmp, self.final)
        fsync_dir(self.final.parent)  # the rename is durable before the manifest can list the shard

    def info(self) -> dict:
        return {
            "name": self.name,
            "sequences": len(self.seq_ids),
            "tokens": self.offsets[-1],
            "response_tokens": self.response_tokens,
            "rejects": self.rejects,
            **({"notes": self.notes} if self.notes else {}),
            "bytes": dir_bytes(self.final if self.final.exists() else self.tmp),
            "committed": now(),
        }

    def abort(self) -> None:
        self.closed = True
        for f, _ in self.parts.values():
            try:
                f.close()
            except OSError:  # its buffered bytes do not fit a full disk; they are deleted anyway
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self.closed:
                self.commit()
        else:
            self.abort()


class StoreWriter:
    """Creates a store (or opens an existing one to add shards) and keeps its manifest.

    One capture writes a store at a time (it holds `lock.writer_lock` for its run); within it, manifest updates
    are serialised by a lock file, and any number of processes may write *different* shards concurrently with
    `ShardWriter(path, name, layout)`.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        layer_ids,
        hidden_size: int,
        dtype: str = "bfloat16",
        codec: str = "blosc-zstd",
        clevel: int = 3,
        chunk_tokens: int = 64,
        shard_tokens: int = 4096,
        teacher_topk: int = 0,
        project_dims: int = 0,
        manifest_extra: dict | None = None,
    ):
        """`project_dims` r > 0: a projected store (`flashdraft.store.projection`): its features [T, r], its basis
        recorded in the manifest's `projection` entry by whoever fits it (`manifest_extra` may carry it)."""
        self.path = Path(path)
        ids = tuple(int(i) for i in layer_ids)
        self.layout = StoreLayout(
            ids,
            int(hidden_size),
            dtype,
            codec,
            clevel,
            chunk_tokens,
            shard_tokens,
            int(teacher_topk),
            int(project_dims),
        )
        fresh = self._fresh_manifest(dict(manifest_extra or {}))
        with manifest_lock(self.path):
            if is_store(self.path):
                self.manifest = read_manifest(self.path)
                self._check_same_capture(fresh)
                srcs = self.manifest.setdefault("sources", [])
                srcs.extend(s for s in fresh["sources"] if s not in srcs)
            else:
                self.manifest = fresh
            self._save()
            if self.manifest is fresh:  # a new store folder: its name in the parent folder too
                fsync_dir(self.path.parent)

    def _fresh_manifest(self, extra: dict) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "created": now(),
            "updated": now(),
            "target": None,
            "chat_template_sha256": None,
            "vocab_size": None,
            "generation": None,
            "sources": [],
            **extra,
            **self.layout.manifest_fields(),
            "counts": {"sequences": 0, "tokens": 0, "response_tokens": 0},
            "shards": [],
        }

    def _check_same_capture(self, fresh: dict) -> None:
        bad = [k for k in _IDENTITY_KEYS if _identity(self.manifest.get(k), k) != _identity(fresh[k], k)]
        if bad:
            detail = "; ".join(f"{k}: store has {self.manifest.get(k)!r}, writer has {fresh[k]!r}" for k in bad)
            raise StoreError(f"{self.path} holds a different capture ({detail}); use a new store directory")

    def _save(self) -> None:
        self.manifest["updated"] = now()
        write_manifest(self.path, self.manifest)

    def shard(self, name: str) -> ShardWriter:
        return ShardWriter(self.path, name, self.layout)

    @property
    def committed(self) -> list[str]:
        return [s["name"] for s in self.manifest["shards"]]

    def register(self, info: dict) -> None:
        """List a committed shard in the manifest (idempotent by name)."""
        with manifest_lock(self.path):
            self.manifest = read_manifest(self.path)
            if info["name"] in self.committed:
                return
            if not shard_exists(self.path, info["name"]):
                raise StoreError(
                    f"cannot register shard {info['name']}: {shard_dir(self.path, info['name'])} does not exist"
                )
            self.manifest["shards"].append(info)
            c = self.manifest["counts"]
            c["sequences"] += info["sequences"]
            c["tokens"] += info["tokens"]
            c["response_tokens"] = c.get("response_tokens", 0) + info.get("response_tokens", 0)
            self._save()

    def update(self, **fields) -> None:
        with manifest_lock(self.path):
            self.manifest = read_manifest(self.path)
            self.manifest.update(fields)
            self._save()

    def entry(self, name: str) -> dict:
        """The manifest entry of the committed shard `name`, as on disk now."""
        self.manifest = read_manifest(self.path)
        return next(e for e in self.manifest["shards"] if e["name"] == name)

    def unlisted_shards(self) -> list[str]:
        """Complete shards on disk that the manifest does not list (a crash between rename and register)."""
        listed = set(self.committed)
        return [
            d.name
            for d in sorted(shards_dir(self.path).iterdir())
            if d.is_dir() and not is_temp(d) and d.name not in listed and shard_is_complete(d)
        ]

    def adopt(self, name: str, seq_ids=None) -> None:
        """List the complete shard `name` found on disk but not in the manifest. With `seq_ids` (those of the task
        that was to write it), only when the shard accounts for exactly those: another's shard is left alone."""
        if seq_ids is not None:
            found, wanted = shard_seq_ids(shard_dir(self.path, name)), set(seq_ids)
            if found != wanted:
                raise StoreError(
                    f"shard {shard_dir(self.path, name)} exists but is not this task's: it holds {len(found)} sequence "
                    f"ids, {len(found & wanted)} of the task's {len(wanted)}; left alone, not adopted. Move it out "
                    "of the store if it does not belong there, then rerun."
                )
        attrs = read_shard_attrs(shard_dir(self.path, name))
        self.register(
            {
                "name": name,
                "sequences": attrs["sequences"],
                "tokens": attrs["tokens"],
                "response_tokens": attrs.get("response_tokens", 0),
                "rejects": attrs.get("rejects", []),
                "bytes": dir_bytes(shard_dir(self.path, name)),
                "committed": now(),
            }
        )

    def remove_temp(self) -> list[str]:
        """Delete leftovers of crashed writers: temporary and incomplete shards, half-written manifest and rejects
        files. Call only holding the writer lock (`lock.writer_lock`), so that no writer is running."""
        gone = []
        for d in shards_dir(self.path).iterdir():
            if is_temp(d) or (d.is_dir() and d.name not in self.committed and not shard_is_complete(d)):
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
        for f in stale_temp_files(self.path):
            f.unlink(missing_ok=True)
            gone.append(f.name)
        return gone


def _identity(v, key: str):
    v = json.loads(json.dumps(v))  # tuples vs lists, int keys vs str keys
    if key == "target" and isinstance(v, dict):  # the same target may live at another path elsewhere
        v = {k: x for k, x in v.items() if k not in ("path", "source")}
    return v


def write_store(
    path, sequences, *, layer_ids, hidden_size, dtype="bfloat16", manifest_extra=None, **layout
) -> StoreReader:
    """Write `sequences` (dicts of seq_id, input_ids, loss_mask, features; teacher, thinking optional) as one
    committed shard."""
    writer = StoreWriter(
        path, layer_ids=layer_ids, hidden_size=hidden_size, dtype=dtype, manifest_extra=manifest_extra, **layout
    )
    with writer.shard(shard_name(0)) as shard:
        for s in sequences:
            shard.append(
                s["seq_id"], s["input_ids"], s["loss_mask"], s["features"], s.get("teacher"), s.get("thinking")
            )
    writer.register(shard.info())
    return StoreReader(path)
