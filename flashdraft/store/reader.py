"""Reading a store: random access to its committed sequences, opened lazily."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flashdraft.store.files import read_manifest, read_shard_attrs, shard_dir
from flashdraft.store.format import StoreError, StoreLayout, decode_layer, layer_key


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


def _concat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def _flat_spans(per_sequence: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sequence [start, end, ...] lists as flat (sequence index, start, end) arrays, one entry a span."""
    counts = np.fromiter((len(x) // 2 for x in per_sequence), dtype=np.int64, count=len(per_sequence))
    flat = np.fromiter((v for x in per_sequence for v in x), dtype=np.int64, count=int(counts.sum()) * 2)
    return np.repeat(np.arange(len(per_sequence)), counts), flat[0::2], flat[1::2]


class StoreReader:
    """Random access to a store's committed sequences. Opens shards lazily; only offsets live in memory.

    Safe to pickle into DataLoader workers (opened arrays are dropped and reopened). `response_spans` is the
    per-sequence index of the loss masks' True runs, (sequence, start, end) arrays, read from the shards'
    attributes; None for a store written before shards kept it.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.layout = StoreLayout.from_manifest(self.manifest)
        self.layer_ids = list(self.layout.layer_ids)
        self.hidden_size = self.layout.hidden_size
        self.dtype = self.layout.dtype
        self._shards: list[_Shard] = []
        seq_ids, lengths, shard_of, index_in, spans = [], [], [], [], []
        for k, entry in enumerate(self.manifest["shards"]):
            d = shard_dir(self.path, entry["name"])
            attrs = read_shard_attrs(d)
            offsets = np.asarray(attrs["offsets"], dtype=np.int64)
            if len(attrs["seq_ids"]) != entry["sequences"] or len(offsets) != entry["sequences"] + 1:
                raise StoreError(
                    f"shard {d}: {len(attrs['seq_ids'])} sequences, the manifest says {entry['sequences']}"
                )
            self._shards.append(_Shard(entry["name"], d, offsets))
            seq_ids.extend(attrs["seq_ids"])
            lengths.append(np.diff(offsets))
            shard_of.append(np.full(len(offsets) - 1, k, dtype=np.int32))
            index_in.append(np.arange(len(offsets) - 1, dtype=np.int64))
            if spans is not None and "response_spans" in attrs:
                spans.extend(attrs["response_spans"])
            else:  # a shard written before the index: start-up reads the loss masks instead
                spans = None
        self.seq_ids: list[str] = seq_ids
        self.lengths = _concat(lengths, np.int64)
        self._shard_of = _concat(shard_of, np.int32)
        self._index_in = _concat(index_in, np.int64)
        self.response_spans = None if spans is None else _flat_spans(spans)
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
