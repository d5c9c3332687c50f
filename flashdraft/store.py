"""The feature store: target hidden states of many sequences in chunked Zarr v3, with a manifest.

Layout of a store directory (readable with plain `zarr.open_group(store/"shards"/name)`):

    manifest.json                 provenance, format, counts, and the list of COMMITTED shards
    rejects.jsonl                 prompts the pipeline refused, one {"source","record_id","reason"} a line
    shards/shard-00000/           one Zarr v3 group per fleet task; attributes: seq_ids, offsets, counts
        input_ids   int32 [T]         all sequences' tokens, flat; sequence j is offsets[j]:offsets[j+1]
        loss_mask   bool  [T]         True on response tokens (generated, EOS included)
        layer_<i>   [T, H]            output of target decoder layer i (hidden_states[i+1]) per token;
                                      uint16 holding bfloat16 bits | float16 | uint8 holding
                                      float8_e4m3fn bits | float32 (manifest "dtype" says which)
        layer_<i>_scale float32 [T]   fp8 only: per-token scale, value = fp8 * scale
        teacher_ids int32 [T, k]      optional (layout teacher_topk = k > 0): row j holds the target's k most
        teacher_logp float16 [T, k]   likely next tokens after token j and their log-probabilities (soft labels
                                      for token j+1); -inf where not captured (prompt tokens before the last)
    shards/.tmp-<name>-<uid>/     a shard being written; renamed to its name once complete

Feature arrays are sharded along tokens (`shard_tokens` rows per file) with small inner chunks
(`chunk_tokens` rows) so that a random sequence costs a few small reads. A shard is written under a
temporary name, flushed, fsynced and renamed; only then is it listed in the manifest. A reader sees
only listed shards, so a crashed writer leaves nothing a reader can trip on.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import math
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
SHARDS = "shards"
TMP_PREFIX = ".tmp-"
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# real dtype -> (zarr dtype holding it, bytes per element)
DTYPES = {
    "bfloat16": ("uint16", 2),
    "float16": ("float16", 2),
    "float8_e4m3": ("uint8", 1),
    "float32": ("float32", 4),
}
CODECS = ("blosc-zstd", "blosc-lz4", "zstd", "none")


class StoreError(RuntimeError):
    """A store is missing, corrupt, or used inconsistently."""


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def layer_key(layer_id: int) -> str:
    return f"layer_{int(layer_id):02d}"


def bytes_per_token(num_layers: int, hidden_size: int, dtype: str, teacher_topk: int = 0) -> int:
    """Uncompressed bytes one token costs: features (+ fp8 scales) + input id + loss mask (+ teacher top-k)."""
    per_layer = hidden_size * DTYPES[dtype][1] + (4 if dtype == "float8_e4m3" else 0)
    return num_layers * per_layer + 4 + 1 + 6 * teacher_topk


@dataclass(frozen=True)
class StoreLayout:
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str = "bfloat16"
    codec: str = "blosc-zstd"
    clevel: int = 3
    chunk_tokens: int = 64  # inner chunk: the unit of a random read
    shard_tokens: int = 4096  # outer chunk: one file per array per shard_tokens rows; the write unit
    teacher_topk: int = 0  # > 0: the target's top-k next-token log-probs per token (teacher_ids/teacher_logp)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise StoreError(f"store dtype {self.dtype!r} not one of {sorted(DTYPES)}")
        if self.codec not in CODECS:
            raise StoreError(f"store codec {self.codec!r} not one of {CODECS}")
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise StoreError(f"layer_ids must be distinct and non-empty, got {list(self.layer_ids)}")
        if self.shard_tokens % self.chunk_tokens:
            raise StoreError(f"shard_tokens {self.shard_tokens} is not a multiple of chunk_tokens {self.chunk_tokens}")
        if self.teacher_topk < 0:
            raise StoreError(f"teacher_topk must be >= 0, got {self.teacher_topk}")

    @classmethod
    def from_manifest(cls, manifest: dict) -> StoreLayout:
        lay = manifest.get("layout", {})
        return cls(tuple(manifest["layer_ids"]), int(manifest["hidden_size"]), manifest["dtype"], **lay)

    def manifest_fields(self) -> dict:
        d = asdict(self)
        layout = {k: d[k] for k in ("codec", "clevel", "chunk_tokens", "shard_tokens")}
        if self.teacher_topk:  # absent when 0, so stores written before the option keep their layout identity
            layout["teacher_topk"] = self.teacher_topk
        return {"layer_ids": list(self.layer_ids), "hidden_size": self.hidden_size, "dtype": self.dtype, "layout": layout}

    def compressors(self, typesize: int):
        from zarr.codecs import BloscCodec, ZstdCodec

        if self.codec == "none":
            return None
        if self.codec == "zstd":
            return ZstdCodec(level=self.clevel)
        cname = self.codec.split("-", 1)[1]
        return BloscCodec(cname=cname, clevel=self.clevel, shuffle="shuffle", typesize=typesize)


# --- encoding features to their stored dtype and back ----------------------------------------


def encode_layer(x: torch.Tensor, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """[S, H] float tensor -> (stored array, fp8 per-token scales or None)."""
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), None
    if dtype == "float16":
        y = x.to(torch.float16)
        if not torch.isfinite(y).all():
            raise StoreError("features overflow float16 (|x| > 65504); store them as bfloat16")
        return y.numpy(), None
    if dtype == "float32":
        return x.to(torch.float32).numpy(), None
    amax = x.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x.float() / scale[:, None]).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy(), scale.numpy().astype(np.float32)


def decode_layer(stored: np.ndarray, dtype: str, scale: np.ndarray | None = None) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(stored).view(np.int16)).view(torch.bfloat16).float()
    if dtype == "float16":
        return torch.from_numpy(np.ascontiguousarray(stored)).float()
    if dtype == "float32":
        return torch.from_numpy(np.ascontiguousarray(stored))
    x = torch.from_numpy(np.ascontiguousarray(stored)).view(torch.float8_e4m3fn).float()
    return x * torch.from_numpy(np.ascontiguousarray(scale))[:, None]


# --- manifest I/O ----------------------------------------------------------------------------


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise StoreError(f"no feature store at {path} (not a directory)")
    if not mpath.is_file():
        raise StoreError(f"{path} is not a feature store: {MANIFEST} is missing")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{mpath} is corrupt: {e}") from e
    if not isinstance(manifest, dict):
        raise StoreError(f"{mpath} is corrupt: not a JSON object")
    missing = [k for k in ("format_version", "layer_ids", "hidden_size", "dtype", "shards") if k not in manifest]
    if missing:
        raise StoreError(f"{mpath} is corrupt: missing keys {missing}")
    if manifest["format_version"] != FORMAT_VERSION:
        raise StoreError(f"{mpath}: format_version {manifest['format_version']} is not {FORMAT_VERSION}")
    return manifest


def read_shard_attrs(shard_dir: Path) -> dict:
    """The shard group's attributes, read straight from its zarr.json (no Zarr machinery: fast)."""
    try:
        return json.loads((shard_dir / "zarr.json").read_text())["attributes"]
    except (OSError, ValueError, KeyError) as e:
        raise StoreError(f"shard {shard_dir} is unreadable: {e}") from e


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def dir_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


# --- writing ---------------------------------------------------------------------------------


class ShardWriter:
    """Writes one shard: appends are buffered to `shard_tokens` rows, commit renames it into place.

    Use as a context manager: a clean exit commits, an exception aborts (deletes the temp dir).
    """

    def __init__(self, store_path: str | Path, name: str, layout: StoreLayout):
        import zarr

        self.layout, self.name = layout, name
        self.shards_dir = Path(store_path) / SHARDS
        self.final = self.shards_dir / name
        if self.final.exists():
            raise StoreError(f"shard {self.final} already exists")
        self.tmp = self.shards_dir / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)
        self.group = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
        lay, H = layout, layout.hidden_size
        zdt = DTYPES[lay.dtype][0]
        self.arrays = {
            "input_ids": self._create("input_ids", (0,), "int32", (lay.shard_tokens,), None),
            "loss_mask": self._create("loss_mask", (0,), "bool", (lay.shard_tokens,), None),
        }
        for i in lay.layer_ids:
            k = layer_key(i)
            self.arrays[k] = self._create(k, (0, H), zdt, (lay.chunk_tokens, H), (lay.shard_tokens, H))
            if lay.dtype == "float8_e4m3":
                self.arrays[k + "_scale"] = self._create(k + "_scale", (0,), "float32", (lay.shard_tokens,), None)
        if lay.teacher_topk:
            k = lay.teacher_topk
            self.arrays["teacher_ids"] = self._create("teacher_ids", (0, k), "int32", (lay.chunk_tokens, k), (lay.shard_tokens, k))
            self.arrays["teacher_logp"] = self._create("teacher_logp", (0, k), "float16", (lay.chunk_tokens, k), (lay.shard_tokens, k))
        self.buffers = {k: [] for k in self.arrays}
        self.buffered = 0
        self.written = 0
        self.seq_ids: list[str] = []
        self._seen: set[str] = set()
        self.rejects: list[dict] = []  # inputs this shard was given and refused, kept with the shard
        self.offsets = [0]
        self.response_tokens = 0
        self.closed = False

    def _create(self, name, shape, dtype, chunks, shards):
        typesize = np.dtype(dtype).itemsize
        return self.group.create_array(
            name, shape=shape, dtype=dtype, chunks=chunks, shards=shards,
            compressors=self.layout.compressors(typesize), fill_value=0,
            config={"write_empty_chunks": True},  # verify can then tell a missing file from zeros
        )  # fmt: skip

    def append(self, seq_id: str, input_ids, loss_mask, features, teacher=None) -> None:
        """teacher: (ids [S, k], log-probs [S, k]) when the layout keeps the target's top-k, else None."""
        if self.closed:
            raise StoreError(f"shard {self.name} is already closed")
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        mask = np.asarray(loss_mask, dtype=bool).reshape(-1)
        feats = torch.as_tensor(features)
        S, n, H = len(ids), len(self.layout.layer_ids), self.layout.hidden_size
        if S == 0:
            raise StoreError(f"sequence {seq_id!r} is empty")
        if mask.shape != (S,) or tuple(feats.shape) != (S, n * H):
            raise StoreError(
                f"sequence {seq_id!r}: input_ids [{S}], loss_mask {list(mask.shape)}, features {list(feats.shape)}; "
                f"expected loss_mask [{S}] and features [{S}, {n}*{H}]"
            )
        if not torch.isfinite(feats).all():
            raise StoreError(f"sequence {seq_id!r}: features contain NaN or Inf")
        if ids.min() < 0 or ids.max() >= 2**31:
            raise StoreError(f"sequence {seq_id!r}: token ids out of int32 range")
        k = self.layout.teacher_topk
        if k and teacher is None:
            raise StoreError(f"sequence {seq_id!r}: this store keeps the target's top-{k} next tokens, none given")
        if k:
            t_ids, t_logp = (torch.as_tensor(x) for x in teacher)
            if tuple(t_ids.shape) != (S, k) or tuple(t_logp.shape) != (S, k):
                raise StoreError(
                    f"sequence {seq_id!r}: teacher ids {list(t_ids.shape)} / log-probs {list(t_logp.shape)}, expected [{S}, {k}]"
                )
        if seq_id in self._seen:
            raise StoreError(f"sequence {seq_id!r} appended twice to shard {self.name}")
        self._seen.add(seq_id)
        self.buffers["input_ids"].append(ids.astype(np.int32))
        self.buffers["loss_mask"].append(mask)
        for j, i in enumerate(self.layout.layer_ids):
            data, scale = encode_layer(feats[:, j * H : (j + 1) * H], self.layout.dtype)
            self.buffers[layer_key(i)].append(data)
            if scale is not None:
                self.buffers[layer_key(i) + "_scale"].append(scale)
        if k:
            self.buffers["teacher_ids"].append(t_ids.to(torch.int32).numpy())
            self.buffers["teacher_logp"].append(t_logp.to(torch.float16).numpy())
        self.seq_ids.append(str(seq_id))
        self.offsets.append(self.offsets[-1] + S)
        self.response_tokens += int(mask.sum())
        self.buffered += S
        if self.buffered >= self.layout.shard_tokens:
            self._flush(final=False)

    def reject(self, seq_id: str, reason: str, **fields) -> None:
        """Record that `seq_id` belonged to this shard's work but was refused (it counts as done)."""
        self.rejects.append({"seq_id": str(seq_id), "reason": reason, **fields})

    def _flush(self, final: bool) -> None:
        """Write whole `shard_tokens` blocks (and, when final, the remainder) so no file is rewritten."""
        step = self.layout.shard_tokens
        n = self.buffered if final else (self.buffered // step) * step
        if n == 0:
            return
        start = self.written
        for k, parts in self.buffers.items():
            data = np.concatenate(parts) if len(parts) > 1 else parts[0]
            arr = self.arrays[k]
            arr.resize((start + n, *arr.shape[1:]))
            arr[start : start + n] = data[:n]
            self.buffers[k] = [data[n:]] if n < len(data) else []
        self.written += n
        self.buffered -= n

    def commit(self) -> dict:
        """Flush, fsync, rename into place; returns the shard's manifest entry."""
        if self.closed:
            raise StoreError(f"shard {self.name} is already closed")
        self._flush(final=True)
        self.group.attrs.update(
            {
                "format_version": FORMAT_VERSION,
                "seq_ids": self.seq_ids,
                "offsets": self.offsets,
                "sequences": len(self.seq_ids),
                "tokens": self.written,
                "response_tokens": self.response_tokens,
                "rejects": self.rejects,
                "layer_ids": list(self.layout.layer_ids),
                "dtype": self.layout.dtype,
                "complete": True,
            }
        )
        _fsync_tree(self.tmp)
        os.rename(self.tmp, self.final)
        self.closed = True
        return self.info()

    def info(self) -> dict:
        return {
            "name": self.name,
            "sequences": len(self.seq_ids),
            "tokens": self.offsets[-1],
            "response_tokens": self.response_tokens,
            "rejects": self.rejects,
            "bytes": dir_bytes(self.final if self.final.exists() else self.tmp),
            "committed": now(),
        }

    def abort(self) -> None:
        self.closed = True
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self.closed:
                self.commit()
        else:
            self.abort()


# Manifest keys that must agree between a store and a writer that appends to it.
_IDENTITY_KEYS = ("layer_ids", "hidden_size", "dtype", "layout", "target", "chat_template_sha256", "vocab_size",
                  "mask_token_id", "generation")  # fmt: skip


class StoreWriter:
    """Creates a store (or opens an existing one to add shards) and keeps its manifest.

    Only one process should register shards at a time (a lock file serialises them); any number of
    processes may write *different* shards concurrently with `ShardWriter(path, name, layout)`.
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
        manifest_extra: dict | None = None,
    ):
        self.path = Path(path)
        self.layout = StoreLayout(
            tuple(int(i) for i in layer_ids), int(hidden_size), dtype, codec, clevel, chunk_tokens, shard_tokens, int(teacher_topk)
        )
        extra = dict(manifest_extra or {})
        fresh = {
            "format_version": FORMAT_VERSION,
            "created": now(),
            "updated": now(),
            "target": None,
            "chat_template_sha256": None,
            "vocab_size": None,
            "mask_token_id": None,
            "generation": None,
            "sources": [],
            **extra,
            **self.layout.manifest_fields(),
            "counts": {"sequences": 0, "tokens": 0, "response_tokens": 0},
            "shards": [],
        }
        with self._lock():
            if (self.path / MANIFEST).exists():
                self.manifest = read_manifest(self.path)
                bad = [k for k in _IDENTITY_KEYS if _identity(self.manifest.get(k), k) != _identity(fresh[k], k)]
                if bad:
                    detail = "; ".join(f"{k}: store has {self.manifest.get(k)!r}, writer has {fresh[k]!r}" for k in bad)
                    raise StoreError(f"{self.path} holds a different capture ({detail}); use a new store directory")
                srcs = self.manifest.setdefault("sources", [])
                srcs.extend(s for s in fresh["sources"] if s not in srcs)
                self._save()
            else:
                self.manifest = fresh
                self._save()

    @contextmanager
    def _lock(self):
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / SHARDS).mkdir(exist_ok=True)
        with open(self.path / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _save(self) -> None:
        self.manifest["updated"] = now()
        write_json_atomic(self.path / MANIFEST, self.manifest)

    def shard(self, name: str) -> ShardWriter:
        return ShardWriter(self.path, name, self.layout)

    @property
    def committed(self) -> list[str]:
        return [s["name"] for s in self.manifest["shards"]]

    def register(self, info: dict) -> None:
        """List a committed shard in the manifest (idempotent by name)."""
        with self._lock():
            self.manifest = read_manifest(self.path)
            if info["name"] in self.committed:
                return
            if not (self.path / SHARDS / info["name"]).is_dir():
                raise StoreError(f"cannot register shard {info['name']}: {self.path / SHARDS / info['name']} does not exist")
            self.manifest["shards"].append(info)
            c = self.manifest["counts"]
            c["sequences"] += info["sequences"]
            c["tokens"] += info["tokens"]
            c["response_tokens"] = c.get("response_tokens", 0) + info.get("response_tokens", 0)
            self._save()

    def update(self, **fields) -> None:
        with self._lock():
            self.manifest = read_manifest(self.path)
            self.manifest.update(fields)
            self._save()

    def unlisted_shards(self) -> list[str]:
        """Complete shards on disk that the manifest does not list (a crash between rename and register)."""
        listed = set(self.committed)
        out = []
        for d in sorted((self.path / SHARDS).iterdir()):
            if d.is_dir() and not d.name.startswith(TMP_PREFIX) and d.name not in listed:
                try:
                    if read_shard_attrs(d).get("complete"):
                        out.append(d.name)
                except StoreError:
                    pass
        return out

    def adopt(self, name: str) -> None:
        attrs = read_shard_attrs(self.path / SHARDS / name)
        self.register(
            {
                "name": name,
                "sequences": attrs["sequences"],
                "tokens": attrs["tokens"],
                "response_tokens": attrs.get("response_tokens", 0),
                "rejects": attrs.get("rejects", []),
                "bytes": dir_bytes(self.path / SHARDS / name),
                "committed": now(),
            }
        )

    def remove_temp(self) -> list[str]:
        """Delete leftovers of crashed shard writers. Call only when no writer is running."""
        gone = []
        for d in (self.path / SHARDS).iterdir():
            if d.name.startswith(TMP_PREFIX) or (d.is_dir() and d.name not in self.committed and not _complete(d)):
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
        return gone


def _complete(shard_dir: Path) -> bool:
    try:
        return bool(read_shard_attrs(shard_dir).get("complete"))
    except StoreError:
        return False


def _identity(v, key: str):
    v = json.loads(json.dumps(v))  # tuples vs lists, int keys vs str keys
    if key == "target" and isinstance(v, dict):  # the same target may live at another path elsewhere
        v = {k: x for k, x in v.items() if k not in ("path", "source")}
    return v


def write_store(path, sequences, *, layer_ids, hidden_size, dtype="bfloat16", manifest_extra=None, shard_name="shard-00000", **layout) -> StoreReader:
    """Write `sequences` (dicts of seq_id, input_ids, loss_mask, features) as one committed shard."""
    writer = StoreWriter(path, layer_ids=layer_ids, hidden_size=hidden_size, dtype=dtype, manifest_extra=manifest_extra, **layout)
    with writer.shard(shard_name) as shard:
        for s in sequences:
            shard.append(s["seq_id"], s["input_ids"], s["loss_mask"], s["features"], s.get("teacher"))
    writer.register(shard.info())
    return StoreReader(path)


# --- reading ---------------------------------------------------------------------------------


@dataclass
class StoredSequence:
    seq_id: str
    input_ids: np.ndarray  # int64 [S]
    loss_mask: np.ndarray  # bool [S]
    features: torch.Tensor  # float32 [S, len(layers) * H]
    teacher_ids: np.ndarray | None = None  # int64 [S, k]: the target's top-k next tokens after each token
    teacher_logp: np.ndarray | None = None  # float32 [S, k]: their log-probabilities (-inf: not captured)


@dataclass
class _Shard:
    name: str
    dir: Path
    offsets: np.ndarray
    arrays: dict = field(default_factory=dict)


class StoreReader:
    """Random access to a store's committed sequences. Opens shards lazily; only offsets live in memory.

    Safe to pickle into DataLoader workers (opened arrays are dropped and reopened).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.layout = StoreLayout.from_manifest(self.manifest)
        self.layer_ids = list(self.layout.layer_ids)
        self.hidden_size = self.layout.hidden_size
        self.dtype = self.layout.dtype
        self._shards: list[_Shard] = []
        seq_ids, lengths, shard_of, index_in = [], [], [], []
        for k, entry in enumerate(self.manifest["shards"]):
            d = self.path / SHARDS / entry["name"]
            attrs = read_shard_attrs(d)
            offsets = np.asarray(attrs["offsets"], dtype=np.int64)
            if len(attrs["seq_ids"]) != entry["sequences"] or len(offsets) != entry["sequences"] + 1:
                raise StoreError(f"shard {d}: {len(attrs['seq_ids'])} sequences, the manifest says {entry['sequences']}")
            self._shards.append(_Shard(entry["name"], d, offsets))
            seq_ids.extend(attrs["seq_ids"])
            lengths.append(np.diff(offsets))
            shard_of.append(np.full(len(offsets) - 1, k, dtype=np.int32))
            index_in.append(np.arange(len(offsets) - 1, dtype=np.int64))
        self.seq_ids: list[str] = seq_ids
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        self.lengths = cat(lengths, np.int64)
        self._shard_of = cat(shard_of, np.int32)
        self._index_in = cat(index_in, np.int64)
        self._by_id = None

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_shards"] = [_Shard(s.name, s.dir, s.offsets) for s in self._shards]
        return state

    def index(self, seq_id: str) -> int:
        if self._by_id is None:
            self._by_id = {s: i for i, s in enumerate(self.seq_ids)}
        return self._by_id[seq_id]

    def _array(self, shard: _Shard, key: str):
        if key not in shard.arrays:
            import zarr

            shard.arrays[key] = zarr.open_array(str(shard.dir / key), mode="r")
        return shard.arrays[key]

    @property
    def teacher_topk(self) -> int:
        return self.layout.teacher_topk

    def read(self, i: int, layers=None, teacher: bool = False) -> StoredSequence:
        """Sequence i with the features of `layers` (default: all), and its teacher top-k if asked."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence index {i} out of range for a store of {len(self)}")
        i = int(i) % len(self)
        layers = self.layer_ids if layers is None else [int(x) for x in layers]
        bad = [x for x in layers if x not in self.layer_ids]
        if bad:
            raise StoreError(f"layers {bad} are not in this store (it holds {self.layer_ids})")
        if teacher and not self.teacher_topk:
            raise StoreError(f"{self.path} holds no teacher top-k (capture it with data.store.teacher_topk=8)")
        shard = self._shards[self._shard_of[i]]
        j = self._index_in[i]
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
        feats = []
        for layer in layers:
            k = layer_key(layer)
            scale = self._array(shard, k + "_scale")[a:b] if self.dtype == "float8_e4m3" else None
            feats.append(decode_layer(self._array(shard, k)[a:b], self.dtype, scale))
        return StoredSequence(
            self.seq_ids[i],
            self._array(shard, "input_ids")[a:b].astype(np.int64),
            self._array(shard, "loss_mask")[a:b].astype(np.bool_),
            torch.cat(feats, dim=-1),
            self._array(shard, "teacher_ids")[a:b].astype(np.int64) if teacher else None,
            self._array(shard, "teacher_logp")[a:b].astype(np.float32) if teacher else None,
        )

    __getitem__ = read

    def shard_loss_masks(self):
        """Per committed shard, (offsets, flat loss_mask): metadata-sized scans without reading features."""
        for shard in self._shards:
            yield shard.offsets, np.asarray(self._array(shard, "loss_mask")[:], dtype=np.bool_)

    def token_sequences(self, skip=()):
        """(input_ids, loss_mask) of every sequence whose id is not in `skip`, a shard read at a time, no features."""
        skip, i = set(skip), 0
        for shard in self._shards:
            ids = np.asarray(self._array(shard, "input_ids")[:], dtype=np.int64)
            mask = np.asarray(self._array(shard, "loss_mask")[:], dtype=np.bool_)
            for a, b in zip(shard.offsets[:-1], shard.offsets[1:]):
                if self.seq_ids[i] not in skip:
                    yield ids[a:b], mask[a:b]
                i += 1

    def __iter__(self):
        return (self.read(i) for i in range(len(self)))


# --- verification ----------------------------------------------------------------------------


def verify_store(path: str | Path, *, progress: bool = True) -> tuple[list[str], dict]:
    """Check a store end to end. Returns (problems, stats); no problems means the store is sound.

    Manifest vs shards (listed shards exist, are complete and agree on counts), every chunk file
    present and readable, offsets monotonic, features finite, sequence ids unique.
    """
    import zarr
    from tqdm import tqdm

    problems: list[str] = []
    try:
        manifest = read_manifest(path)
        layout = StoreLayout.from_manifest(manifest)
    except (StoreError, TypeError, KeyError) as e:
        return [str(e)], {}
    path = Path(path)
    keys = ["input_ids", "loss_mask"] + [layer_key(i) for i in layout.layer_ids]
    if layout.dtype == "float8_e4m3":
        keys += [layer_key(i) + "_scale" for i in layout.layer_ids]
    if layout.teacher_topk:
        keys += ["teacher_ids", "teacher_logp"]
    seen: dict[str, str] = {}
    total_seq = total_tok = 0
    shards = manifest["shards"]
    for entry in tqdm(shards, desc="verify", unit="shard", disable=not progress):
        name, d = entry["name"], path / SHARDS / entry["name"]
        if not d.is_dir():
            problems.append(f"shard {name} is listed in the manifest but missing on disk")
            continue
        try:
            attrs = read_shard_attrs(d)
        except StoreError as e:
            problems.append(str(e))
            continue
        if not attrs.get("complete"):
            problems.append(f"shard {name} is not marked complete")
        offsets = np.asarray(attrs.get("offsets", []), dtype=np.int64)
        ids = attrs.get("seq_ids", [])
        T = int(offsets[-1]) if len(offsets) else 0
        if len(offsets) != len(ids) + 1 or (len(offsets) and offsets[0] != 0) or (np.diff(offsets) <= 0).any():
            problems.append(f"shard {name}: offsets are not 0-based, strictly increasing, one per sequence + 1")
        if entry["sequences"] != len(ids) or entry["tokens"] != T:
            problems.append(
                f"shard {name}: manifest says {entry['sequences']} sequences / {entry['tokens']} tokens, "
                f"shard holds {len(ids)} / {T}"
            )
        for s in ids:
            if s in seen:
                problems.append(f"sequence {s} is in both {seen[s]} and {name}")
            seen[s] = name
        total_seq += len(ids)
        total_tok += T
        for key in keys:
            try:
                arr = zarr.open_array(str(d / key), mode="r")
            except Exception as e:  # noqa: BLE001 - any failure to open is a problem to report
                problems.append(f"shard {name}: array {key} cannot be opened ({type(e).__name__}: {e})")
                continue
            if arr.shape[0] != T:
                problems.append(f"shard {name}: array {key} has {arr.shape[0]} rows, offsets say {T}")
                continue
            outer = (arr.shards or arr.chunks)[0]
            for c in range(math.ceil(T / outer)):
                chunk_file = d / key / "c" / str(c) / "0" if arr.ndim == 2 else d / key / "c" / str(c)
                if not chunk_file.is_file():
                    problems.append(f"shard {name}: chunk file {chunk_file.relative_to(path)} is missing")
                    continue
                try:
                    block = arr[c * outer : min(T, (c + 1) * outer)]
                except Exception as e:  # noqa: BLE001
                    problems.append(f"shard {name}: chunk {key}/c/{c} is unreadable ({type(e).__name__}: {e})")
                    continue
                if key.startswith("layer_") and not key.endswith("_scale"):
                    vals = decode_layer(block, layout.dtype, np.ones(len(block), np.float32))
                    if not torch.isfinite(vals).all():
                        problems.append(f"shard {name}: {key} rows {c * outer}..{c * outer + len(block)} hold NaN/Inf")
                elif key.endswith("_scale") and not (np.isfinite(block).all() and (block > 0).all()):
                    problems.append(f"shard {name}: {key} holds non-positive or non-finite scales")
    c = manifest.get("counts", {})
    listed = (sum(e["sequences"] for e in shards), sum(e["tokens"] for e in shards))
    for what, n in (("shards hold", (total_seq, total_tok)), ("shard entries sum to", listed)):
        if (c.get("sequences"), c.get("tokens")) != n:
            problems.append(f"manifest counts {c.get('sequences')} sequences / {c.get('tokens')} tokens, {what} {n[0]} / {n[1]}")
    stats = {"shards": len(shards), "sequences": total_seq, "tokens": total_tok, "bytes": dir_bytes(path / SHARDS)}
    return problems, stats
