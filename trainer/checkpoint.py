"""Atomic checkpoints: DeepSpeed state + per-rank RNG + the drafter in the published HF format.

    <ckpt_root>/step-00000100/    DeepSpeed files (weights, optimizer, scheduler, client state),
                                  rng-rank<r>.pt, client_state.json (the client state, readable before
                                  an engine exists: the dtype to rebuild it in), drafter/ (config.json +
                                  model.safetensors)
    <ckpt_root>/latest            the name of the newest complete checkpoint

A checkpoint is written under `.tmp-<tag>` and renamed into place; `latest` is replaced atomically
afterwards, so a crash at any moment leaves the previous checkpoint as `latest`.
"""

from __future__ import annotations

import json
import os
import shutil
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


def load_checkpoint(engine, root: str | Path, tag: str) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; returns the client state."""
    path, client_state = engine.load_checkpoint(
        str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise RuntimeError(f"checkpoint {Path(root) / tag} could not be loaded")
    rng_file = Path(root) / tag / f"rng-rank{_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return client_state or {}
