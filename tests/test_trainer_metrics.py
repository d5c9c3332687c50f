"""metrics.jsonl + W&B offline: rows appended, a resume drops the rows it will recompute."""

import json

from trainer.metrics import MetricsLog


def test_offline_wandb_and_jsonl_survive_a_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = MetricsLog(tmp_path, project="flashdraft-test", config={"lr": 1.0})
    for step in (1, 2, 3):
        log.log({"loss": 4.0 - step, "tau": 1.0}, step)
    log.close()
    assert list(tmp_path.glob("wandb/offline-run-*"))
    run_id = (tmp_path / "wandb_id").read_text()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    log = MetricsLog(tmp_path, resume_step=2)  # resumed from the checkpoint of step 2
    log.log({"loss": 0.5}, 3)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 3.0), (2, 2.0), (3, 0.5)]
    assert (tmp_path / "wandb_id").read_text() == run_id
