"""Atomic, durable checkpoints: DeepSpeed state + per-rank RNG + the drafter in the published HF format.

    <ckpt_root>/step-00000100/    DeepSpeed files (weights, optimizer, scheduler, client state),
                                  rng-rank<r>.pt, client_state.json (the client state, readable before
                                  an engine exists: the dtype to rebuild it in, the stores' basis),
                                  files.json (the files a resume reads, as the save wrote them),
                                  drafter/ (config.json + model.safetensors)
    <ckpt_root>/step-00000100-1/  the same step saved again (a rerun over the same folder): its own folder
    <ckpt_root>/latest            the name of the newest complete checkpoint

A checkpoint is written under `.tmp-<tag>`, every file of it fsynced, renamed into place and the folder fsynced;
only then is `latest` replaced (written, fsynced, renamed, folder fsynced). No save deletes or overwrites the
folder `latest` names: a step saved again gets a new folder, and the older ones go only once `latest` names the new
one. So a crash or a power loss at any moment leaves `latest` naming a complete checkpoint. The tag read from
`latest` must be a checkpoint name (`step-NNNNNNNN`, `step-NNNNNNNN-K`): one that leads elsewhere is refused.

A resume (`resume_tag`) takes the checkpoint `latest` names if it is intact (`checkpoint_problem`: its folder, its
client state, every file files.json lists, every torch file read whole against its zip CRCs), else the newest intact
one, saying what was wrong with which path; it never trains afresh over checkpoints (no intact one: refused, naming
each). Rank 0 decides and every rank takes its choice. Saves run under the trainer's lock (`trainer.run_lock`), which
is also what makes removing the temporary folders of killed saves (`remove_unfinished_saves`) safe.

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
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

from flashdraft.durable import exchange, fsync_dir, fsync_tree, write_text_durably

LATEST = "latest"
CLIENT_STATE = "client_state.json"
FILES = "files.json"  # the checkpoint's top-level files (what a resume reads), listed once every rank wrote its own
RESUME_NEEDS = ("global_step", "dtype")  # what client_state.json must hold before an engine is built
TAG = re.compile(r"step-([0-9]{8,})(?:-([0-9]+))?")  # what `_new_tag` makes: the only tags `latest` may name


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be resumed from as it stands (a `latest` naming something else, no intact
    checkpoint, a file that cannot be read, another feature basis)."""


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


def named_tag(root: str | Path) -> str | None:
    """The checkpoint `latest` names, whether or not its folder exists (None: no `latest`). A tag that is not a
    checkpoint name (`../../..`, an absolute path) is refused: it would lead out of `root`."""
    p = Path(root) / LATEST
    if not p.is_file():
        return None
    tag = p.read_text().strip()
    if not TAG.fullmatch(tag):
        raise CheckpointError(
            f"{p} names {tag[:200]!r}, not a checkpoint of the form step-NNNNNNNN; refused. Write one of "
            f"{checkpoint_tags(root)[-3:] or 'the checkpoints'} into it, or delete it: the resume then takes the "
            "newest intact checkpoint"
        )
    return tag


def latest_tag(root: str | Path) -> str | None:
    """The checkpoint `latest` names (None: no `latest`, or its folder is gone); see `named_tag`."""
    tag = named_tag(root)
    return tag if tag is not None and (Path(root) / tag).is_dir() else None


def from_rank0(value):
    """Rank 0's `value`, on every rank (itself where there is no process group)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def checkpoint_problem(folder: Path) -> str | None:
    """What keeps the checkpoint `folder` from being resumed, naming the path (None: intact). Reads every torch
    file whole (its zip's CRCs: torch itself checks none, and would load flipped bytes as weights); a file that
    holds more than tensors is left for the load to refuse (`UnsafeCheckpoint`)."""
    if not folder.is_dir():
        return f"{folder} is missing"
    if not any(folder.iterdir()):
        return f"{folder} is empty"
    problem = _client_state_problem(folder / CLIENT_STATE) or _missing_file(folder)
    for path in sorted(folder.glob("*.pt")):
        problem = problem or _torch_file_problem(path)
    return problem


def _client_state_problem(path: Path) -> str | None:
    if not path.is_file():
        return f"{path} is missing (every save of this trainer writes one: an older trainer's checkpoint, or damaged)"
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{path} is unreadable ({type(e).__name__}: {e})"
    missing = [k for k in RESUME_NEEDS if k not in state] if isinstance(state, dict) else list(RESUME_NEEDS)
    return f"{path} does not hold {missing}" if missing else None


def _missing_file(folder: Path) -> str | None:
    """A file the save wrote (files.json) that is gone; without files.json (older saves), a missing model file."""
    listing = folder / FILES
    if not listing.is_file():
        found = any(folder.glob("*model_states.pt"))
        return None if found else f"{folder} holds no model states file (*model_states.pt)"
    try:
        names = json.loads(listing.read_text())["files"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return f"{listing} is unreadable ({type(e).__name__}: {e})"
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        return f"{folder / missing[0]} is missing ({len(missing)} of the {len(names)} files the save wrote)"
    return None


def _torch_file_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()  # reads every member, checks its CRC
    except (OSError, EOFError, zipfile.BadZipFile, ValueError) as e:
        return f"{path} is not a whole torch file, truncated or damaged ({type(e).__name__}: {e})"
    return f"{path} is damaged: its part {bad} fails its CRC" if bad else None


def _list_files(folder: Path) -> None:
    """files.json: the top-level files of the checkpoint `folder` (each rank's have been written)."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != FILES)
    (folder / FILES).write_text(json.dumps({"files": names}, indent=1) + "\n")


def _choose_resume(root: Path) -> str | None:
    """The checkpoint to resume from (rank 0): the one `latest` names if it is intact, else the newest intact one,
    said with what was wrong with which path; None where there is none at all. Raises CheckpointError where there are
    checkpoints and none is intact."""
    named, tags = named_tag(root), checkpoint_tags(root)
    if named is None and not tags:
        return None
    problems = []
    for tag in [named] * (named is not None) + [t for t in reversed(tags) if t != named]:
        began = time.perf_counter()
        problem = checkpoint_problem(root / tag)
        if problem is None:
            read = sum(p.stat().st_size for p in (root / tag).glob("*.pt")) / 2**20
            print(
                f"checked {root / tag}: {read:.1f} MiB of torch files read whole in "
                f"{time.perf_counter() - began:.1f} s",
                flush=True,
            )
            if tag != named:
                print(fallback_note(root, named, tag, problems), flush=True)
            return tag
        problems.append(problem)
    raise CheckpointError(
        f"no checkpoint in {root} can be resumed: {'; '.join(problems)}. Refused rather than training from step 1 "
        f"over them. Put back an intact checkpoint folder (the resume takes the newest), or, to start afresh, move "
        f"{root} aside or train into another train.out_dir (train.resume=false also starts afresh here, and its "
        f"saves delete these folders)"
    )


def fallback_note(root: Path, named: str | None, tag: str, problems: list[str]) -> str:
    """What a resume from `tag` rather than the checkpoint `latest` names says."""
    why = f"{root / LATEST} names {named}, which cannot be resumed" if named else f"{root / LATEST} is missing"
    broken = f": {'; '.join(problems)}" if problems else ""
    return (
        f"{why}{broken}; resuming from the newest intact checkpoint, {root / tag}: the steps after it are trained "
        f"again (a broken folder goes when its step is saved again)"
    )


def resume_tag(root: str | Path) -> str | None:
    """The checkpoint to resume from (`_choose_resume`), decided by rank 0 and taken by every rank (all call it)."""
    choice = None
    if _rank() == 0:
        try:
            choice = {"tag": _choose_resume(Path(root))}
        except Exception as e:
            from_rank0({"error": f"{type(e).__name__}: {e}"})
            raise
    choice = from_rank0(choice)
    if "error" in choice:
        raise CheckpointError(f"rank 0 refused the resume: {choice['error']}")
    return choice["tag"]


def remove_unfinished_saves(root: str | Path) -> None:
    """Delete the temporary folders of saves a killed run left (rank 0). Only under the trainer's lock: another
    trainer's save in progress looks the same."""
    if _rank() != 0:
        return
    for stale in Path(root).glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
        print(f"removed {stale}: the unfinished save of a run that stopped while saving", flush=True)


def _new_tag(root: Path, step: int) -> str:
    """The folder name for a checkpoint of `step`: `step-NNNNNNNN`, or `step-NNNNNNNN-K` when that step has a
    folder already (decided by rank 0, told to every rank)."""
    tag = None
    if _rank() == 0:
        base = f"step-{step:08d}"
        same = [_tag_key(t)[1] for t in checkpoint_tags(root) if _tag_key(t)[0] == step]
        tag = base if not same else f"{base}-{max(same) + 1}"
    return from_rank0(tag)


def export_drafter(drafter_cls, config, state: dict, out: Path, dtype=None, projection=None, card=None) -> Path:
    """Write the drafter as a published-format HF folder at `out`, replacing it in one atomic step: a crash at any
    moment leaves the previous drafter or the new one at `out`, both whole. A drafter trained on a projected store
    (`projection`: its basis) is exported folded: fc = fc' @ P^T reads the raw features, its config's
    `feature_projection` (the basis's sha256) marked folded. `card(folder)` (None: no card) writes the folder's
    README.md (`flashdraft.modelcard.write_card`) before the swap, so the card comes and goes with its weights."""
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
    if card is not None:
        card(tmp)
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
    """All ranks call this, holding the run's lock. `export(path)` (rank 0, may be None) writes the HF drafter into
    the checkpoint."""
    root = Path(root)
    tag = _new_tag(root, step)
    tmp_root = root / f".tmp-{tag}"
    if _rank() == 0:
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
    if _rank() == 0:
        _list_files(tmp_root / tag)
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
    """`torch.load` of one checkpoint file that builds tensors, builtins and `deepspeed_state_types()` only. A file
    that cannot be read raises CheckpointError naming it (torch's own errors do not)."""
    try:
        with torch.serialization.safe_globals(deepspeed_state_types()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")  # the type refused
        raise UnsafeCheckpoint(
            f"{path}: refused to load: it holds more than tensors and DeepSpeed's state ({detail})"
        ) from e
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(
            f"{path}: cannot be read ({type(e).__name__}: {first}). Move its checkpoint folder aside and rerun: the "
            "resume takes the newest intact checkpoint"
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
