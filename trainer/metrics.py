"""Training metrics: `metrics.jsonl` in the run dir (always) and W&B (offline unless configured)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path


class MetricsLog:
    """Rank 0 writes; other ranks get a no-op logger."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, wandb_mode: str = "offline", project: str = "flashdraft",
                 entity: str | None = None, name: str | None = None, config: dict | None = None, resume_step: int | None = None):
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
            self.run = wandb.init(project=project, entity=entity, name=name, id=run_id, resume="allow", mode=mode,
                                  dir=str(run_dir), config=config)
            print(f"wandb ({mode}): {self.run.dir}", flush=True)

    def _truncate(self, step: int) -> None:
        """Drop lines past the resumed step: they are recomputed, identically, after a resume."""
        keep = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
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
