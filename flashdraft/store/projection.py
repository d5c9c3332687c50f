"""A projected feature store: the L captured layers' features [T, L*H] stored as r < L*H linear combinations.

The drafter reads the captured layers only through `fc`, a linear map L*H -> H, so a fixed linear projection P
[L*H, r] of the features loses nothing a drafter trained on the projected features could have used through `fc'`
[H, r]: exported as `fc = fc' @ P^T` [H, L*H], that drafter on RAW features computes exactly what it computed on
projected ones, in the published format every engine loads (`fold_fc`).

`data.store.project: pca` fits P once per store from a calibration sample (`data.store.calibration_tokens`, the
first captured tokens): each of the L*H channels is scaled by its root mean square (Qwen and SmolLM carry massive
activations in a few channels, which would otherwise own the top directions), then the top-r eigenvectors V_r of
the scaled features' second moment (not centred: the map stays purely linear, so the fold is exact) give
P = diag(1/rms) @ V_r. `lift` = diag(rms) @ V_r is its right inverse (P^T @ lift = I_r): a raw drafter's fc
[H, L*H] becomes the projected fc' = fc @ lift (exact for a drafter folded from the same basis; for any other the
fc that reads the PCA reconstruction of the features).

The basis is kept in the store as `projection.safetensors` (float32 `projection` and `rms`; `lift` = diag(rms^2) P
is derived), its sha256 in
the manifest's `projection` entry; `load_projection` refuses a file whose bytes do not hash to it, naming the path.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.store.format import StoreError

PROJECTION_FILE = "projection.safetensors"
METHODS = ("pca",)
DEFAULT_CALIBRATION_TOKENS = 32768
_DIMS = re.compile(r"^\s*([0-9]*\.?[0-9]+)?\s*[hH]\s*$")


def resolve_dims(value, hidden_size: int, input_dims: int, key: str = "data.store.project_dims") -> int:
    """`data.store.project_dims` as a number of dimensions: an int, or "H", "2H", "2.5H" (times the hidden size).
    `key`: the setting's name in errors (the transcode command's is `project_dims`)."""
    if isinstance(value, str):
        m = _DIMS.match(value)
        if m is None and value.strip().isdigit():
            dims = int(value)
        elif m is None:
            raise StoreError(f"{key} must be a number or a multiple of H (H, 2H, 2.5H), got {value!r}")
        else:
            dims = round(float(m.group(1) or 1) * hidden_size)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        dims = int(value)
    else:
        raise StoreError(f"{key} must be a number or a multiple of H (H, 2H, 2.5H), got {value!r}")
    if not 1 <= dims < input_dims:
        raise StoreError(
            f"{key} {value!r} is {dims} dimensions; a projection keeps 1..{input_dims - 1} of the "
            f"{input_dims} captured ({input_dims // hidden_size} layers x {hidden_size})"
        )
    return dims


def check_method(method) -> str | None:
    if method in (None, "none", "null", ""):
        return None
    if method not in METHODS:
        raise StoreError(f"data.store.project must be null or one of {METHODS}, got {method!r}")
    return method


PROJECTION_OPTIONS = ("project", "project_dims", "calibration_tokens")


def split_store_options(options: dict, layer_ids, hidden_size: int) -> tuple[dict, dict | None]:
    """`data.store` settings -> (the layout's keyword arguments, project_dims included, and the manifest's first
    `projection` entry: what to fit, its sha256 not known yet; None for raw features)."""
    layout = {k: v for k, v in options.items() if k not in PROJECTION_OPTIONS}
    method = check_method(options.get("project"))
    if method is None:
        return layout, None
    input_dims = len(list(layer_ids)) * int(hidden_size)
    dims = resolve_dims(options.get("project_dims", "2H"), int(hidden_size), input_dims)
    tokens = int(options.get("calibration_tokens", DEFAULT_CALIBRATION_TOKENS))
    if tokens < 1:
        raise StoreError(f"data.store.calibration_tokens must be >= 1, got {tokens}")
    layout["project_dims"] = dims
    return layout, {"method": method, "dims": dims, "input_dims": input_dims, "calibration_tokens": tokens}


@dataclass(frozen=True)
class Projection:
    """A store's basis: `projection` P [D, r], `lift` [D, r] (P^T @ lift = I), `rms` [D]; `sha256` of its file."""

    projection: torch.Tensor
    lift: torch.Tensor
    rms: torch.Tensor
    meta: dict
    sha256: str = ""

    @property
    def dims(self) -> int:
        return int(self.projection.shape[1])

    @property
    def input_dims(self) -> int:
        return int(self.projection.shape[0])

    def apply(self, features: torch.Tensor) -> torch.Tensor:
        """[..., D] raw features -> [..., r], computed in float32 on the features' device, returned in their
        dtype (a float32 result where they are fp8)."""
        P = self.projection.to(features.device)
        out = features.to(torch.float32) @ P
        return out if features.dtype not in (torch.bfloat16, torch.float16) else out.to(features.dtype)

    def to(self, device) -> Projection:
        """The basis with its projection on `device` (where the capture applies it)."""
        return Projection(self.projection.to(device), self.lift, self.rms, self.meta, self.sha256)

    def provenance(self) -> dict:
        """What a drafter trained on this basis records (`feature_projection` in its config)."""
        return {
            "method": self.meta.get("method", "pca"),
            "dims": self.dims,
            "input_dims": self.input_dims,
            "sha256": self.sha256,
        }


@torch.no_grad()
def fit_projection(features, dims: int, *, method: str = "pca", chunk: int = 4096) -> Projection:
    """The basis of `dims` directions from calibration features ([N, D] tensor, or a list of [n_i, D] tensors),
    on their device: per-channel RMS scale, then the top eigenvectors of the scaled features' second moment
    (float64, not centred). Deterministic signs (each direction's largest entry positive)."""
    method = check_method(method)
    if method is None:
        raise StoreError("fit_projection needs a method")
    parts = [features] if isinstance(features, torch.Tensor) else list(features)
    parts = [p.reshape(-1, p.shape[-1]) for p in parts if p.numel()]
    if not parts:
        raise StoreError("no calibration tokens to fit the projection on")
    D, device = parts[0].shape[-1], parts[0].device
    if not 1 <= dims < D:
        raise StoreError(f"a projection keeps 1..{D - 1} of {D} dimensions, asked for {dims}")
    n, sq = 0, torch.zeros(D, dtype=torch.float64, device=device)
    for p in parts:
        for a in range(0, len(p), chunk):
            x = p[a : a + chunk].to(torch.float64)
            sq += (x * x).sum(0)
            n += len(x)
    rms = (sq / n).sqrt()
    rms = torch.where(rms > 0, rms, torch.ones_like(rms))  # a channel always 0: left unscaled
    second = torch.zeros(D, D, dtype=torch.float64, device=device)
    for p in parts:
        for a in range(0, len(p), chunk):
            y = p[a : a + chunk].to(torch.float64) / rms
            second += y.T @ y
    second /= n
    evals, evecs = torch.linalg.eigh(second)  # ascending
    order = torch.argsort(evals, descending=True)[:dims]
    V = evecs[:, order]
    sign = torch.sign(V.gather(0, V.abs().argmax(0, keepdim=True)))
    V = V * torch.where(sign == 0, torch.ones_like(sign), sign)
    total = float(evals.clamp(min=0).sum())
    kept = float(evals[order].clamp(min=0).sum())
    meta = {
        "method": method,
        "dims": int(dims),
        "input_dims": int(D),
        "calibration_tokens": int(n),
        "scaled": "rms",
        "centred": False,
        "explained": kept / total if total > 0 else 1.0,
    }
    return Projection(
        (V / rms[:, None]).float().cpu().contiguous(),
        (V * rms[:, None]).float().cpu().contiguous(),
        rms.float().cpu().contiguous(),
        meta,
    )


def calibration_prefix(sequences, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of `sequences` (token id lists, taken in order and only as far as needed): whole
    sequences, the last one cut to the tokens left (at least one token of each taken)."""
    seqs, n = [], 0
    for ids in sequences:
        seqs.append(ids[: max(1, tokens - n)])
        n += len(seqs[-1])
        if n >= tokens:
            break
    return seqs


def fit_store_basis(store_path, features, dims: int, *, method: str = "pca", **meta) -> tuple[dict, str]:
    """Fit the basis of a projected store on its calibration `features` (`fit_projection`) and write it into the
    store (`save_projection`, with `meta`); returns the manifest's `projection` entry and a line saying what the
    basis keeps."""
    proj = fit_projection(features, dims, method=method)
    entry = save_projection(store_path, proj, **meta)
    line = (
        f"projection basis fitted on {proj.meta['calibration_tokens']} tokens: "
        f"{proj.dims} of {proj.input_dims} dims keep {100 * proj.meta['explained']:.1f}% of the scaled "
        f"features' second moment (sha256 {entry['sha256'][:12]})"
    )
    return entry, line


def projection_file(store_path) -> Path:
    return Path(store_path) / PROJECTION_FILE


def temp_projection_file(store_path) -> Path:
    """Where the basis is written before it is renamed into place (`write_bytes_durably`'s temporary name; a crash may
    leave it: only a writer holding the store's writer lock deletes it)."""
    path = projection_file(store_path)
    return path.with_name(path.name + ".tmp")


def _write_file_atomic(path: Path, data: bytes) -> None:
    """`data` into `path` durably (`flashdraft.durable.write_bytes_durably`); a full disk is a DiskFullError naming
    `path` and the free bytes."""
    from flashdraft.durable import write_bytes_durably
    from flashdraft.store.space import naming_disk_full

    path.parent.mkdir(parents=True, exist_ok=True)
    with naming_disk_full(path):
        write_bytes_durably(path, data)


def save_projection(store_path, proj: Projection, **meta) -> dict:
    """Write the basis into the store (atomically, fsynced; a full disk a DiskFullError naming the file and the free
    bytes); returns the manifest's `projection` entry."""
    from safetensors.torch import save

    path = projection_file(store_path)
    info = {**proj.meta, **meta}
    tensors = {"projection": proj.projection, "rms": proj.rms}  # lift = diag(rms^2) P: derived on load
    # serialised in memory and written here, not by safetensors' save_file, whose full disk is a SafetensorError
    # without an errno: this write's ENOSPC becomes the DiskFullError every store write raises
    _write_file_atomic(path, save(tensors, metadata={"flashdraft": json.dumps(info, sort_keys=True)}))
    return {**info, "file": PROJECTION_FILE, "sha256": file_sha256(path)}


def copy_projection(from_store, to_store) -> dict:
    """Copy the basis of projected store `from_store` into `to_store` byte for byte (so both name the same sha256 and
    train together), its bytes checked against `from_store`'s manifest; returns `to_store`'s `projection` entry."""
    from flashdraft.store.files import read_manifest

    entry = read_manifest(from_store).get("projection") or {}
    source = Path(from_store) / entry.get("file", PROJECTION_FILE)
    data = source.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise StoreError(f"{source}: the projection basis does not hash to its manifest's sha256; not copied")
    _write_file_atomic(projection_file(to_store), data)
    return {**entry, "file": PROJECTION_FILE, "basis_from": str(Path(from_store).resolve())}


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_projection(store_path, manifest: dict | None = None) -> Projection | None:
    """The store's basis, its bytes checked against the manifest's sha256 (StoreError naming the file when they
    differ or it is missing); None for a store of raw features."""
    from safetensors import safe_open

    if manifest is None:
        from flashdraft.store.files import read_manifest

        manifest = read_manifest(store_path)
    entry = manifest.get("projection")
    dims = int(manifest.get("layout", {}).get("project_dims", 0) or 0)
    if not entry and not dims:
        return None
    path = Path(store_path) / (entry or {}).get("file", PROJECTION_FILE)
    if not entry or not entry.get("sha256"):
        raise StoreError(f"{store_path}: a projected store ({dims} dims) whose basis is not recorded yet ({path})")
    if not path.is_file():
        raise StoreError(f"{path}: the store's projection basis is missing")
    sha = file_sha256(path)
    if sha != entry["sha256"]:
        raise StoreError(
            f"{path}: the projection basis is damaged (sha256 {sha[:12]}, the manifest records {entry['sha256'][:12]})"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in ("projection", "rms")}
    except Exception as e:  # noqa: BLE001 - any unreadable file is a damaged store
        raise StoreError(f"{path}: the projection basis is unreadable: {e}") from e
    lift = (t["projection"].double() * t["rms"].double()[:, None] ** 2).float()  # diag(rms) V = diag(rms^2) P
    proj = Projection(t["projection"], lift, t["rms"], dict(entry), sha)
    if dims and proj.dims != dims:
        raise StoreError(f"{path}: the basis has {proj.dims} dimensions, the store's layout {dims}")
    return proj


def projection_sha(manifest: dict) -> str | None:
    """The sha256 of a store's basis as its manifest records it; None for raw features."""
    entry = manifest.get("projection")
    if entry:
        return entry.get("sha256")
    if int(manifest.get("layout", {}).get("project_dims", 0) or 0):
        return "(not recorded)"
    return None
