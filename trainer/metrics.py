"""Training metrics: sums over micro-batches and ranks (`Tally`), written to `metrics.jsonl` in the run dir (always)
and W&B (offline unless configured)."""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path

import torch

from trainer.engine import all_sum
from trainer.loss import summarize

LOSS, COUNT, NONFINITE, STATS = 0, 1, 2, 3  # a Tally's values: loss sum, count, non-finite losses, then the stats


class Tally:
    """The losses and loss stats of micro-batches, summed on the device they were computed on: adding one waits for
    nothing on it. Values: the loss sum, a count (tokens when training, micro-batches in eval), how many of the
    losses were not finite, then pos_correct [B], pos_total [B], accept, blocks. `summed_over_ranks` brings several
    tallies to the host at once: one collective and one copy."""

    def __init__(self, block_size: int, device="cpu"):
        self.block_size = block_size
        self.values = torch.zeros(STATS + 2 * block_size + 2, dtype=torch.float64, device=device)

    def add(self, loss, count: float, stats: dict) -> None:
        """`loss`: a tensor on the tally's device (or a number); `count`: a number the host knows."""
        v = self.values
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
            v[NONFINITE] += loss.isfinite().logical_not()
        elif not math.isfinite(loss):
            v[NONFINITE] += 1
        v[LOSS] += loss
        v[COUNT] += count
        parts = [stats["pos_correct"], stats["pos_total"], stats["accept"][None], stats["blocks"][None]]
        v[STATS:] += torch.cat(parts).to(v)

    def all_sum(self) -> Tally:
        all_sum(self.values)
        return self

    @property
    def loss(self) -> float:
        return float(self.values[LOSS])

    @property
    def count(self) -> float:
        return float(self.values[COUNT])

    def summary(self, num_losses: int) -> dict:
        """loss (the summed loss over `num_losses`), acc, acc_k and tau (`trainer.loss.summarize`)."""
        return summarize_values(self.values.tolist(), self.block_size, num_losses)


def summed_over_ranks(tallies: list[Tally]) -> list[list[float]]:
    """Each tally's values summed over the ranks, on the host: one collective and one copy for all of them (every
    rank must call it alike)."""
    return all_sum(torch.stack([t.values for t in tallies])).tolist()


def summarize_values(values: list[float], block_size: int, num_losses: int) -> dict:
    """A tally's values on the host as logged metrics (`trainer.loss.summarize`): the loss sum over `num_losses`."""
    b, v = block_size, values[STATS:]
    stats = {"pos_correct": v[:b], "pos_total": v[b : 2 * b], "accept": v[2 * b], "blocks": v[2 * b + 1]}
    return summarize(stats, values[LOSS], num_losses)


class MetricsLog:
    """Rank 0 writes; other ranks get a no-op logger."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool = True,
        wandb_mode: str = "offline",
        project: str = "flashdraft",
        entity: str | None = None,
        name: str | None = None,
        config: dict | None = None,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            self._truncate(resume_step)
        mode = os.environ.get("WANDB_MODE", wandb_mode)
        if mode != "disabled":
            import wandb

            id_file = Path(run_dir) / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id)
            self.run = wandb.init(
                project=project,
                entity=entity,
                name=name,
                id=run_id,
                resume="allow",
                mode=mode,
                dir=str(run_dir),
                config=config,
            )
            print(f"wandb ({mode}): {self.run.dir}", flush=True)

    def _truncate(self, step: int) -> None:
        """Drop lines past the resumed step: they are recomputed, identically, after a resume."""
        keep = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
