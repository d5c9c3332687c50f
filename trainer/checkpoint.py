"""Atomic checkpoints: DeepSpeed state + per-rank RNG + the drafter in the published HF format.

    <ckpt_root>/step-00000100/    DeepSpeed files (weights, optimizer, scheduler, client state),
                                  rng-rank<r>.pt, client_state.json (the client state, readable before
                                  an engine exists: the dtype to rebuild it in), drafter/ (config.json +
                                  model.safetensors)
    <ckpt_root>/latest            the name of the newest complete checkpoint

A checkpoint is written under `.tmp-<tag>` and renamed into place; `latest` is replaced atomically
afterwards, so a crash at any moment leaves the previous checkpoint as `latest`.

A resume unpickles nothing but tensors, builtins and the few DeepSpeed classes its state holds: DeepSpeed loads
with `torch.load(weights_only=False)`, which runs whatever code a planted file names.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

LATEST = "latest"
CLIENT_STATE = "client_state.json"


def _barrier():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def latest_tag(root: str | Path) -> str | None:
    p = Path(root) / LATEST
    if not p.is_file():
        return None
    tag = p.read_text().strip()
    return tag if (Path(root) / tag).is_dir() else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def export_drafter(drafter_cls, config, state: dict, out: Path, dtype=None) -> Path:
    """Write the drafter as a published-format HF folder at `out`, replacing it atomically."""
    model = drafter_cls(config)
    model.load_state_dict(state)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, dtype=dtype)
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    return out


def save_checkpoint(engine, root: str | Path, step: int, client_state: dict, *, export=None, keep: int = 3) -> Path:
    """All ranks call this. `export(path)` (rank 0, may be None) writes the HF drafter into the checkpoint."""
    root = Path(root)
    tag = f"step-{step:08d}"
    tmp_root = root / f".tmp-{tag}"
    if _rank() == 0:
        for stale in root.glob(".tmp-step-*"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        tmp_root.mkdir(parents=True)
    _barrier()
    engine.save_checkpoint(str(tmp_root), tag=tag, client_state=client_state, save_latest=False)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp_root / tag / f"rng-rank{_rank()}.pt")
    if _rank() == 0:
        (tmp_root / tag / CLIENT_STATE).write_text(json.dumps(client_state, indent=1, default=str) + "\n")
    if export is not None:
        export(tmp_root / tag / "drafter")
    _barrier()
    final = root / tag
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp_root / tag, final)
        shutil.rmtree(tmp_root, ignore_errors=True)
        _write_atomic(root / LATEST, tag + "\n")
        done = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def read_client_state(root: str | Path, tag: str) -> dict | None:
    """The client state a checkpoint was saved with, read without an engine (None for checkpoints older than
    the file)."""
    path = Path(root) / tag / CLIENT_STATE
    return json.loads(path.read_text()) if path.is_file() else None


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file that holds more than tensors and DeepSpeed's own state: it is not loaded."""


def deepspeed_state_types() -> list:
    """The classes DeepSpeed's checkpoint files pickle besides tensors and builtins (each file of a checkpoint
    saved with ZeRO 1, 2 and 3, float32 and bfloat16, loaded with weights_only=True: these were refused)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(path, map_location=None):
    """`torch.load` of one checkpoint file that builds tensors, builtins and `deepspeed_state_types()` only."""
    try:
        with torch.serialization.safe_globals(deepspeed_state_types()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")  # the type refused
        raise UnsafeCheckpoint(
            f"{path}: refused to load: it holds more than tensors and DeepSpeed's state ({detail})"
        ) from e


class _WeightsOnlyLoads:
    """The engine's checkpoint engine, its every `load` through `load_weights_only`; the rest passes through."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path, map_location=None):
        return load_weights_only(path, map_location)


@contextmanager
def _weights_only_loads(engine):
    """For the duration of a DeepSpeed load: every file DeepSpeed reads for `engine.load_checkpoint` (model,
    optimizer and ZeRO partition states) goes through its `checkpoint_engine.load`, which is swapped here."""
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = _WeightsOnlyLoads(inner)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner


def load_checkpoint(engine, root: str | Path, tag: str) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; returns the client state. A file holding more
    than tensors and DeepSpeed's state raises UnsafeCheckpoint naming it, before any of it runs."""
    with _weights_only_loads(engine):
        path, client_state = engine.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    if path is None:
        raise RuntimeError(f"checkpoint {Path(root) / tag} could not be loaded")
    rng_file = Path(root) / tag / f"rng-rank{_rank()}.pt"
    if rng_file.is_file():
        rng = load_weights_only(rng_file)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return client_state or {}
