"""Atomic, durable checkpoints: DeepSpeed state + per-rank RNG + the drafter in the published HF format.

    <ckpt_root>/step-00000100/    DeepSpeed files (weights, optimizer, scheduler, client state),
                                  rng-rank<r>.pt, client_state.json (the client state, readable before
                                  an engine exists: the dtype to rebuild it in), drafter/ (config.json +
                                  model.safetensors)
    <ckpt_root>/step-00000100-1/  the same step saved again (a rerun over the same folder): its own folder
    <ckpt_root>/latest            the name of the newest complete checkpoint

A checkpoint is written under `.tmp-<tag>`, every file of it fsynced, renamed into place and the folder fsynced;
only then is `latest` replaced (written, fsynced, renamed, folder fsynced). No save deletes or overwrites the
folder `latest` names: a step saved again gets a new folder, and the older ones go only once `latest` names the new
one. So a crash or a power loss at any moment leaves `latest` naming a complete checkpoint. The tag read from
`latest` must be a checkpoint name (`step-NNNNNNNN`, `step-NNNNNNNN-K`): one that leads elsewhere is refused.

A resume unpickles nothing but tensors, builtins and the few DeepSpeed classes its state holds: DeepSpeed loads
with `torch.load(weights_only=False)`, which runs whatever code a planted file names.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from flashdraft.durable import exchange, fsync_dir, fsync_tree, write_text_durably

LATEST = "latest"
CLIENT_STATE = "client_state.json"
TAG = re.compile(r"step-([0-9]{8,})(?:-([0-9]+))?")  # what `_new_tag` makes: the only tags `latest` may name


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be resumed from as it stands (a `latest` naming something else)."""


def _barrier():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _tag_key(tag: str) -> tuple[int, int]:
    m = TAG.fullmatch(tag)
    return int(m[1]), int(m[2] or 0)


def checkpoint_tags(root: str | Path) -> list[str]:
    """The checkpoint folders under `root`, oldest first (by step, then by how often the step was saved)."""
    root = Path(root)
    found = [p.name for p in root.iterdir() if p.is_dir() and TAG.fullmatch(p.name)] if root.is_dir() else []
    return sorted(found, key=_tag_key)


def latest_tag(root: str | Path) -> str | None:
    """The checkpoint `latest` names (None: no `latest`, or its folder is gone). A tag that is not a checkpoint
    name (`../../..`, an absolute path) is refused: it would lead out of `root`."""
    p = Path(root) / LATEST
    if not p.is_file():
        return None
    tag = p.read_text().strip()
    if not TAG.fullmatch(tag):
        raise CheckpointError(
            f"{p} names {tag[:200]!r}, not a checkpoint of the form step-NNNNNNNN; refused. Point it at one of "
            f"{checkpoint_tags(root)[-3:] or 'the checkpoints'} or start afresh with train.resume=false"
        )
    return tag if (Path(root) / tag).is_dir() else None


def _new_tag(root: Path, step: int) -> str:
    """The folder name for a checkpoint of `step`: `step-NNNNNNNN`, or `step-NNNNNNNN-K` when that step has a
    folder already (decided by rank 0, told to every rank)."""
    tag = None
    if _rank() == 0:
        base = f"step-{step:08d}"
        same = [_tag_key(t)[1] for t in checkpoint_tags(root) if _tag_key(t)[0] == step]
        tag = base if not same else f"{base}-{max(same) + 1}"
    import torch.distributed as dist

    if dist.is_initialized():
        box = [tag]
        dist.broadcast_object_list(box, src=0)
        tag = box[0]
    return tag


def export_drafter(drafter_cls, config, state: dict, out: Path, dtype=None, projection=None) -> Path:
    """Write the drafter as a published-format HF folder at `out`, replacing it in one atomic step: a crash at any
    moment leaves the previous drafter or the new one at `out`, both whole. A drafter trained on a projected store
    (`projection`: its basis) is exported folded: fc = fc' @ P^T reads the raw features, its config's
    `feature_projection` (the basis's sha256) marked folded."""
    out = Path(out)
    if projection is not None:
        from flashdraft.model import fold_projection

        state = {**state, "fc.weight": fold_projection(state["fc.weight"], projection.projection)}
        config = copy.deepcopy(config)
        config.feature_projection = {**projection.provenance(), "folded": True}
    model = drafter_cls(config)
    model.load_state_dict(state)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.with_name(f".{out.name}.tmp"), out.with_name(f".{out.name}.old")
    if not out.exists() and old.is_dir():  # a crash mid-way through the two-rename fallback below: put it back
        os.replace(old, out)
        fsync_dir(out.parent)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, dtype=dtype)
    fsync_tree(tmp)
    if not out.exists():
        os.replace(tmp, out)
        fsync_dir(out.parent)
    elif exchange(tmp, out):  # the new folder at `out`, the previous one (a folder or a link to one) at `tmp`
        if tmp.is_symlink():
            tmp.unlink()
        else:
            shutil.rmtree(tmp)
    else:  # no atomic exchange here (NFS): two renames; the previous drafter waits at `old` meanwhile
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(old)
    return out


def save_checkpoint(engine, root: str | Path, step: int, client_state: dict, *, export=None, keep: int = 3) -> Path:
    """All ranks call this. `export(path)` (rank 0, may be None) writes the HF drafter into the checkpoint."""
    root = Path(root)
    tag = _new_tag(root, step)
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
    _barrier()  # every rank's writes done: rank 0's export renames folders that another rank's walk would meet
    fsync_tree(tmp_root / tag)  # each rank: the files it wrote are on disk before the checkpoint is named
    _barrier()
    final = root / tag
    if _rank() == 0:
        os.replace(tmp_root / tag, final)
        fsync_dir(root)  # the folder's name is durable before `latest` names it
        shutil.rmtree(tmp_root, ignore_errors=True)
        write_text_durably(root / LATEST, tag + "\n")
        _prune(root, tag, keep)
    _barrier()
    return final


def _prune(root: Path, newest: str, keep: int) -> None:
    """Delete earlier saves of `newest`'s step, then all but the `keep` newest checkpoints (`latest` names
    `newest` by now)."""
    step = _tag_key(newest)[0]
    for tag in checkpoint_tags(root):
        if tag != newest and _tag_key(tag)[0] == step:
            shutil.rmtree(root / tag, ignore_errors=True)
    done = checkpoint_tags(root)
    for old in done[:-keep] if keep > 0 else []:
        if old != newest:
            shutil.rmtree(root / old, ignore_errors=True)


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
