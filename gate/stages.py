"""The gate's capture and training, both in this process: the pipeline's capture into the gate's store, then the
trainer on that store alone (its labels shifted where `gate.plant=labels+1`)."""

from __future__ import annotations

import contextlib
import os
import time

from flashdraft.config import Config
from gate.plants import planted_labels


def capture(cfg: Config) -> list[tuple[list[int], list[int]]]:
    """The gate's store, captured in this process; (prompt, response) token lists of each sequence."""
    from flashdraft.store import StoreReader
    from pipeline.__main__ import capture_command

    if capture_command(cfg) != 0:
        raise RuntimeError(f"the gate's capture into {cfg.features_dir} failed (its summary is above)")
    pairs = []
    for ids, mask in StoreReader(cfg.features_dir).token_sequences():
        first = int(mask.argmax()) if mask.any() else len(ids)
        pairs.append((ids[:first].tolist(), ids[first:].tolist()))
    if not pairs:
        raise RuntimeError(f"the gate's capture stored no sequence in {cfg.features_dir}")
    return pairs


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def trainer_environment():
    """The variables of the trainer's one-process start (trainer.engine.setup_distributed_env), put back after it.
    Its process group stays: DeepSpeed keeps its own handle on it, and a second gate in this process reuses it."""
    saved = {k: os.environ.get(k) for k in DIST_VARS}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train_drafter(cfg: Config) -> dict:
    """Train on the gate's store (labels shifted where planted); the trainer's last step's metrics."""
    from trainer.train import train

    t0 = time.perf_counter()
    with trainer_environment(), planted_labels(cfg.gate.plant):
        final = train(cfg.train, cfg.drafter)
    final["train_s"] = time.perf_counter() - t0
    return final
