"""Reading a store: random access to its committed sequences, straight from the shards' data files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashdraft.store.files import array_file, listed_shard_attrs, read_manifest, shard_dir
from flashdraft.store.format import (
    FEATURE_SCALES,
    FEATURES,
    StoreError,
    StoreLayout,
    decode_features,
    read_index,
)
from flashdraft.store.projection import load_projection

INDEX_CACHE = 512  # shard indexes (array x shard) kept in memory: 16 bytes an inner chunk each


@dataclass
class StoredSequence:
    seq_id: str
    input_ids: np.ndarray  # int64 [S]
    loss_mask: np.ndarray  # bool [S]
    features: torch.Tensor  # float32 [S, len(layers) * H] ([S, r] in a projected store)
    teacher_ids: np.ndarray | None = None  # int64 [S, k]: the target's top-k next tokens after each token
    teacher_logp: np.ndarray | None = None  # float32 [S, k]: their log-probabilities (-inf: not captured)


@dataclass
class _Shard:
    name: str
    dir: Path
    offsets: np.ndarray


def _concat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def _flat_spans(per_sequence: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sequence [start, end, ...] lists as flat (sequence index, start, end) arrays, one entry a span."""
    counts = np.fromiter((len(x) // 2 for x in per_sequence), dtype=np.int64, count=len(per_sequence))
    flat = np.fromiter((v for x in per_sequence for v in x), dtype=np.int64, count=int(counts.sum()) * 2)
    return np.repeat(np.arange(len(per_sequence)), counts), flat[0::2], flat[1::2]


class StoreReader:
    """Random access to a store's committed sequences. A read takes the inner chunks it needs from each array's
    data file; only offsets, ids, spans and a bounded cache of shard indexes live in memory.

    Safe to pickle into DataLoader workers (the index cache is dropped). `response_spans` is the
    per-sequence index of the loss masks' True runs, (sequence, start, end) arrays, read from the shards'
    attributes; None for a store written before shards kept it. `thinking` is each sequence's chat-template
    enable_thinking (True, False, or None: not recorded, as in a shard of a non-thinking target or an older one).
    A projected store's basis is checked on open (its file's sha256 against the manifest's: a damaged one is
    refused, naming the file); `projection_sha256` names it (None: raw features).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.layout = StoreLayout.from_manifest(self.manifest)
        self.layer_ids = list(self.layout.layer_ids)
        self.hidden_size = self.layout.hidden_size
        self.dtype = self.layout.dtype
        proj = load_projection(self.path, self.manifest)
        self.projection_sha256 = proj.sha256 if proj is not None else None
        self._shards: list[_Shard] = []
        seq_ids, lengths, shard_of, index_in, spans, thinking = [], [], [], [], [], []
        for k, entry in enumerate(self.manifest["shards"]):
            d = shard_dir(self.path, entry["name"])
            attrs = listed_shard_attrs(self.path, entry["name"])
            offsets = np.asarray(attrs["offsets"], dtype=np.int64)
            if len(attrs["seq_ids"]) != entry["sequences"] or len(offsets) != entry["sequences"] + 1:
                raise StoreError(
                    f"shard {d}: {len(attrs['seq_ids'])} sequences, the manifest says {entry['sequences']}"
                )
            self._shards.append(_Shard(entry["name"], d, offsets))
            seq_ids.extend(attrs["seq_ids"])
            thinking.extend(attrs.get("thinking") or [None] * len(attrs["seq_ids"]))
            lengths.append(np.diff(offsets))
            shard_of.append(np.full(len(offsets) - 1, k, dtype=np.int32))
            index_in.append(np.arange(len(offsets) - 1, dtype=np.int64))
            if spans is not None and "response_spans" in attrs:
                spans.extend(attrs["response_spans"])
            else:  # a shard written before the index: start-up reads the loss masks instead
                spans = None
        self.seq_ids: list[str] = seq_ids
        self.thinking: list[bool | None] = thinking
        self.lengths = _concat(lengths, np.int64)
        self._shard_of = _concat(shard_of, np.int32)
        self._index_in = _concat(index_in, np.int64)
        self.response_spans = None if spans is None else _flat_spans(spans)
        self._by_id = None
        self._specs = self.layout.array_specs()
        self._indexes: dict = {}

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_indexes"] = {}
        return state

    def index(self, seq_id: str) -> int:
        if self._by_id is None:
            self._by_id = {s: i for i, s in enumerate(self.seq_ids)}
        return self._by_id[seq_id]

    def _index(self, shard: _Shard, key: str) -> np.ndarray:
        """The (offset, nbytes) shard-index entries of array `key`'s data file, a few hundred kept in memory."""
        if (shard.name, key) not in self._indexes:
            ct = self.layout.chunk_tokens
            n = -(-int(shard.offsets[-1]) // ct)
            entries = read_index(array_file(shard.dir, key, 1 + len(self._specs[key][1])), n)
            if len(self._indexes) >= INDEX_CACHE:
                self._indexes.pop(next(iter(self._indexes)))
            self._indexes[(shard.name, key)] = entries
        return self._indexes[(shard.name, key)]

    def _rows(self, shard: _Shard, key: str, a: int, b: int, seq_id: str) -> np.ndarray:
        """Rows a:b of array `key`, straight from its data file: the inner chunks covering them read at once, each
        checked (crc32c) and decompressed. Plain zarr reads the same bytes, at a far higher cost a chunk."""
        dtype, row = self._specs[key]
        if b <= a:
            return np.zeros((0, *row), dtype=dtype)
        ct = self.layout.chunk_tokens
        c0, c1 = a // ct, (b - 1) // ct + 1
        out = np.empty(((c1 - c0) * ct, *row), dtype=dtype)
        try:
            entries = self._index(shard, key)[c0:c1].astype(np.int64)
            lo, hi = int(entries[:, 0].min()), int(entries.sum(1).max())
            with open(array_file(shard.dir, key, 1 + len(row)), "rb") as f:
                f.seek(lo)
                blob = np.frombuffer(f.read(hi - lo), dtype=np.uint8)
            for k, (offset, nbytes) in enumerate(entries - [lo, 0]):
                out[k * ct : (k + 1) * ct] = self.layout.decode_chunk(blob[offset : offset + nbytes], dtype, row)
        except (OSError, ValueError, RuntimeError) as e:
            raise StoreError(
                f"{self.path}: shard {shard.name}, array {key}, rows {a}..{b} (sequence {seq_id}) is unreadable: "
                f"{type(e).__name__}: {e}"
            ) from e
        return out[a - c0 * ct : b - c0 * ct]

    @property
    def teacher_topk(self) -> int:
        return self.layout.teacher_topk

    @property
    def projected(self) -> bool:
        return bool(self.layout.project_dims)

    def projection(self):
        """The store's basis (`flashdraft.store.projection.Projection`, checked again), None for raw features."""
        return load_projection(self.path, self.manifest)

    def read(self, i: int, layers=None, teacher: bool = False, upcast: bool = True) -> StoredSequence:
        """Sequence i with the features of `layers` (default: all), and its teacher top-k if asked. Features are
        float32, or with `upcast` False in the stored precision where torch has it (bf16, fp16: `decode_features`).
        A projected store has no features a layer: `layers` must be all of them, in order (its r columns come
        back)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence index {i} out of range for a store of {len(self)}")
        i = int(i) % len(self)
        layers = self.layer_ids if layers is None else [int(x) for x in layers]
        bad = [x for x in layers if x not in self.layer_ids]
        if self.projected and layers != self.layer_ids:
            raise StoreError(
                f"{self.path} is a projected store ({self.layout.project_dims} dims mixing layers {self.layer_ids}): "
                f"layers {layers} cannot be read from it apart; read all of them (or use a raw store)"
            )
        if bad:
            raise StoreError(f"layers {bad} are not in this store (it holds {self.layer_ids})")
        if teacher and not self.teacher_topk:
            raise StoreError(f"{self.path} holds no teacher top-k (capture it with data.store.teacher_topk=8)")
        shard, sid = self._shards[self._shard_of[i]], self.seq_ids[i]
        j = self._index_in[i]
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
        rows = lambda key: self._rows(shard, key, a, b, sid)  # noqa: E731
        stored, scale = rows(FEATURES), rows(FEATURE_SCALES) if self.dtype == "float8_e4m3" else None
        if layers != self.layer_ids:  # a subset (or another order): those layers' columns and scales
            which = [self.layer_ids.index(x) for x in layers]
            stored = stored.reshape(b - a, len(self.layer_ids), -1)[:, which].reshape(b - a, -1)
            scale = scale[:, which] if scale is not None else None
        return StoredSequence(
            sid,
            rows("input_ids").astype(np.int64),
            rows("loss_mask").astype(np.bool_),
            decode_features(stored, self.dtype, scale, upcast),
            rows("teacher_ids").astype(np.int64) if teacher else None,
            rows("teacher_logp").astype(np.float32) if teacher else None,
        )

    __getitem__ = read

    def shard_loss_masks(self):
        """Per committed shard, (offsets, flat loss_mask): metadata-sized scans without reading features."""
        for shard in self._shards:
            yield shard.offsets, self._rows(shard, "loss_mask", 0, int(shard.offsets[-1]), "(all)").astype(np.bool_)

    def token_sequences(self, skip=()):
        """(input_ids, loss_mask) of every sequence whose id is not in `skip`, a shard read at a time, no features."""
        skip, i = set(skip), 0
        for shard in self._shards:
            ids = self._rows(shard, "input_ids", 0, int(shard.offsets[-1]), "(all)").astype(np.int64)
            mask = self._rows(shard, "loss_mask", 0, int(shard.offsets[-1]), "(all)").astype(np.bool_)
            for a, b in zip(shard.offsets[:-1], shard.offsets[1:]):
                if self.seq_ids[i] not in skip:
                    yield ids[a:b], mask[a:b]
                i += 1

    def __iter__(self):
        return (self.read(i) for i in range(len(self)))
