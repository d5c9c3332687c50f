"""One trainer a run: the lock of `train.out_dir`, held by rank 0 for the whole run.

It is the store's writer lock on another folder (`flashdraft.store.lock.folder_lock`): `fcntl.flock` on
`<out_dir>/trainer.lock`, which names its holder (host, pid, start time); a second trainer on the same out_dir is
refused at once, naming the first; a lock file left by a dead trainer is taken over, and that is said. Only rank 0
takes it (the other ranks of the same run are other processes, often on the same host, and would refuse each other):
they wait for its outcome, and every rank stops when it is refused. Everything a run writes into its out_dir
(checkpoints, the removal of unfinished saves, metrics.jsonl, W&B) happens while it is held.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path

from flashdraft.store.lock import FolderLock, folder_lock
from trainer.checkpoint import from_rank0


class TrainerLockedError(RuntimeError):
    """Another trainer runs in this train.out_dir."""


TRAINER_LOCK = FolderLock(
    "trainer.lock",
    TrainerLockedError,
    "is in use by",
    "One trainer runs in a train.out_dir at a time: wait for that one to end, or train into another train.out_dir.",
)


@contextmanager
def trainer_lock(out_dir: str | Path):
    """Hold the run's lock for the block (all ranks call it; rank 0 holds it). Raises TrainerLockedError on every
    rank, naming the holder, when another trainer holds it."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with ExitStack() as held:
        refusal = None
        if rank == 0:
            try:
                held.enter_context(folder_lock(out_dir, "trainer", TRAINER_LOCK))
            except TrainerLockedError as e:
                refusal = str(e)
        refusal = from_rank0(refusal)  # the other ranks wait here for rank 0's lock
        if refusal is not None:
            raise TrainerLockedError(refusal)
        yield
