"""What a store's arrays hold: the layout of one capture (layers, hidden size, dtype, chunking, compression) and
how features are encoded to their stored dtype and back.

The features of all captured layers are one array, `features` [T, L * H], layer after layer in `layer_ids` order
(columns j*H:(j+1)*H hold layer_ids[j]): uint16 holding bfloat16 bits | float16 | uint8 holding float8_e4m3fn
bits (with a float32 scale per token and layer, `features_scale` [T, L]: value = fp8 * scale) | float32.
A projected store (layout `project_dims` r > 0, `flashdraft.store.projection`) holds `features` [T, r] instead: the
L layers' features times the store's basis P [L * H, r], with one fp8 scale a token ([T, 1]).

Format 3: every array of a shard is ONE file, a Zarr v3 shard (sharding codec) covering all the shard's rows, made
of inner chunks of `chunk_tokens` rows (the unit of a random read), each compressed (`codec`) and checksummed
(crc32c), followed by the shard index (offset and length of every inner chunk, crc32c too). The writer streams the
inner chunks to the file as rows arrive (`encode_chunk`) and appends the index at commit (`encode_index`); plain
zarr reads the result. Formats 1 and 2 (an array per layer) are refused by `files.read_manifest`;
`flashdraft.store.convert` rewrites them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

FORMAT_VERSION = 3
FORMAT_NOTES = {  # what each format version laid out, for the error that refuses an old store
    1: "one file per array per shard_tokens rows, an array per layer",
    2: "one file per array per shard, an array per layer",
    3: "one file per array per shard, the layers in one features array",
}
FEATURES = "features"  # [T, L * H] every captured layer's features
FEATURE_SCALES = "features_scale"  # [T, L] fp8 only
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


def layer_key(layer_id: int) -> str:
    """Layer i's own array in formats 1 and 2 (`convert` reads them); format 3 stacks the layers in `features`."""
    return f"layer_{int(layer_id):02d}"


def bytes_per_token(num_layers: int, hidden_size: int, dtype: str, teacher_topk: int = 0, project_dims: int = 0) -> int:
    """Uncompressed bytes one token costs: features (+ fp8 scales) + input id + loss mask (+ teacher top-k).
    `project_dims` r > 0: r projected features and one fp8 scale a token instead of the layers'."""
    fp8 = dtype == "float8_e4m3"
    if project_dims:
        feats = project_dims * DTYPES[dtype][1] + (4 if fp8 else 0)
    else:
        feats = num_layers * (hidden_size * DTYPES[dtype][1] + (4 if fp8 else 0))
    return feats + 4 + 1 + 6 * teacher_topk


@dataclass(frozen=True)
class StoreLayout:
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str = "bfloat16"
    codec: str = "blosc-zstd"
    clevel: int = 3
    chunk_tokens: int = 64  # inner chunk: the unit of a random read
    shard_tokens: int = 4096  # the write unit: rows buffered before their inner chunks are encoded and written
    teacher_topk: int = 0  # > 0: the target's top-k next-token log-probs per token (teacher_ids/teacher_logp)
    project_dims: int = 0  # > 0: features projected to this many dims by the store's basis (`projection`)

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
        if not 0 <= self.project_dims < len(self.layer_ids) * self.hidden_size:
            raise StoreError(
                f"project_dims must be 0 (raw features) or below the {len(self.layer_ids) * self.hidden_size} "
                f"captured dims, got {self.project_dims}"
            )

    @property
    def feature_dims(self) -> int:
        """Columns of the `features` array: r where projected, else L * H."""
        return self.project_dims or len(self.layer_ids) * self.hidden_size

    @property
    def scale_groups(self) -> int:
        """fp8 scales a token: one a layer, or one where projected (the basis mixes the layers)."""
        return 1 if self.project_dims else len(self.layer_ids)

    @classmethod
    def from_manifest(cls, manifest: dict) -> StoreLayout:
        lay = manifest.get("layout", {})
        return cls(tuple(manifest["layer_ids"]), int(manifest["hidden_size"]), manifest["dtype"], **lay)

    def manifest_fields(self) -> dict:
        d = asdict(self)
        layout = {k: d[k] for k in ("codec", "clevel", "chunk_tokens", "shard_tokens")}
        if self.teacher_topk:  # absent when 0, so stores written before the option keep their layout identity
            layout["teacher_topk"] = self.teacher_topk
        if self.project_dims:  # likewise
            layout["project_dims"] = self.project_dims
        return {
            "layer_ids": list(self.layer_ids),
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "layout": layout,
        }

    def array_keys(self) -> list[str]:
        """Every array of a shard of this layout."""
        return list(self.array_specs())

    def array_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every array of a shard: key -> (zarr dtype, shape of one row)."""
        k = self.teacher_topk
        specs = {
            "input_ids": ("int32", ()),
            "loss_mask": ("bool", ()),
            FEATURES: (DTYPES[self.dtype][0], (self.feature_dims,)),
        }
        if self.dtype == "float8_e4m3":
            specs[FEATURE_SCALES] = ("float32", (self.scale_groups,))
        if k:
            specs.update({"teacher_ids": ("int32", (k,)), "teacher_logp": ("float16", (k,))})
        return specs

    def compressors(self, typesize: int) -> list:
        """The inner chunks' bytes-to-bytes codecs in zarr's terms: the compressor, then a crc32c checksum."""
        from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

        if self.codec == "none":
            return [Crc32cCodec()]
        if self.codec == "zstd":
            return [ZstdCodec(level=self.clevel), Crc32cCodec()]
        cname = self.codec.split("-", 1)[1]
        return [BloscCodec(cname=cname, clevel=self.clevel, shuffle="shuffle", typesize=typesize), Crc32cCodec()]

    def encode_chunk(self, block: np.ndarray) -> bytes:
        """One inner chunk (exactly `chunk_tokens` rows) as its bytes in a shard file: what `compressors` decode."""
        import numcodecs

        block = np.ascontiguousarray(block, dtype=block.dtype.newbyteorder("<"))
        if self.codec == "none":
            data = block.tobytes()
        elif self.codec == "zstd":
            data = numcodecs.Zstd(level=self.clevel).encode(block.tobytes())
        else:
            cname = self.codec.split("-", 1)[1]
            data = numcodecs.Blosc(cname=cname, clevel=self.clevel, shuffle=numcodecs.Blosc.SHUFFLE).encode(block)
        return with_crc32c(bytes(data))

    def decode_chunk(self, data, dtype: str, row: tuple[int, ...]) -> np.ndarray:
        """The rows of one inner chunk from its bytes in a shard file (what `encode_chunk` wrote): checksum
        checked, decompressed, [chunk_tokens, *row] of zarr dtype `dtype`."""
        import google_crc32c
        import numcodecs

        data = np.frombuffer(data, dtype=np.uint8)  # a view: slices below copy nothing
        if google_crc32c.value(data[:-4]) != int(data[-4:].view("<u4")[0]):
            raise StoreError("inner chunk checksum mismatch")
        if self.codec == "none":
            raw = data[:-4]
        elif self.codec == "zstd":
            raw = numcodecs.Zstd().decode(data[:-4])
        else:
            raw = numcodecs.Blosc().decode(data[:-4])
        return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).reshape(self.chunk_tokens, *row)


def with_crc32c(data: bytes) -> bytes:
    """`data` followed by its crc32c, little-endian: zarr's crc32c codec."""
    import google_crc32c

    return data + np.uint32(google_crc32c.value(data)).astype("<u4").tobytes()


def encode_index(entries: np.ndarray) -> bytes:
    """A shard index: (offset, nbytes) uint64 per inner chunk, little-endian, then its crc32c (zarr's default)."""
    return with_crc32c(np.ascontiguousarray(entries, dtype="<u8").tobytes())


def index_nbytes(n_chunks: int) -> int:
    return 16 * n_chunks + 4


def decode_index(tail: bytes, n_chunks: int) -> np.ndarray:
    """The [n_chunks, 2] (offset, nbytes) entries of a shard index (the file's last `index_nbytes` bytes)."""
    body = tail[:-4]
    if len(tail) != index_nbytes(n_chunks) or with_crc32c(body) != tail:
        raise StoreError("shard index checksum mismatch")
    return np.frombuffer(body, dtype="<u8").reshape(n_chunks, 2)


def read_index(file, n_chunks: int) -> np.ndarray:
    """The shard index at the end of a data file of `n_chunks` inner chunks (StoreError when it is damaged or the
    file is too short to hold it)."""
    with open(file, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - index_nbytes(n_chunks)))
        return decode_index(f.read(), n_chunks)


def mask_runs(mask: np.ndarray) -> list[int]:
    """The True runs of a 1-D bool mask as a flat [start, end, start, end, ...] list (ends exclusive): a sequence's
    response spans, kept in its shard's attributes so that start-up reads no loss mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]])))
    return edges.tolist()


def encode_features(x: torch.Tensor, num_layers: int, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """[S, L * H] float tensor -> (stored [S, L * H], fp8 scales [S, L] (one a token and layer) or None).
    A projected store's [S, r] features pass `num_layers` 1: one scale a token."""
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), None
    if dtype == "float16":
        y = x.to(torch.float16)
        if not torch.isfinite(y).all():
            raise StoreError("features overflow float16 (|x| > 65504); store them as bfloat16")
        return y.numpy(), None
    if dtype == "float32":
        return x.to(torch.float32).numpy(), None
    per_layer = x.float().reshape(len(x), num_layers, -1)
    amax = per_layer.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (per_layer / scale[:, :, None]).to(torch.float8_e4m3fn).reshape(len(x), -1)
    return q.view(torch.uint8).numpy(), scale.numpy().astype(np.float32)


def decode_features(
    stored: np.ndarray, dtype: str, scale: np.ndarray | None = None, upcast: bool = True
) -> torch.Tensor:
    """Stored rows [S, L * H] -> features: float32, or with `upcast` False the stored precision where torch has it
    (bf16, fp16: no conversion, no copy); fp8 is always dequantised to float32 with its scales [S, L]."""
    if dtype == "bfloat16":
        x = torch.from_numpy(np.ascontiguousarray(stored).view(np.int16)).view(torch.bfloat16)
        return x.float() if upcast else x
    if dtype == "float16":
        x = torch.from_numpy(np.ascontiguousarray(stored))
        return x.float() if upcast else x
    if dtype == "float32":
        return torch.from_numpy(np.ascontiguousarray(stored))
    scale = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32))
    x = torch.from_numpy(np.ascontiguousarray(stored)).view(torch.float8_e4m3fn).float()
    return (x.reshape(len(x), scale.shape[1], -1) * scale[:, :, None]).reshape(len(x), -1)
