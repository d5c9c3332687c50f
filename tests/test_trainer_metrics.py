"""Metrics: micro-batch sums summarised; metrics.jsonl + W&B offline: rows appended, a resume drops the rows it will
recompute."""

import json

import pytest
import torch

from trainer.loss import summarize
from trainer.metrics import MetricsLog, Tally


def test_a_tally_sums_micro_batches_before_it_divides():
    def stats(correct, total, accept, blocks):
        return {
            "pos_correct": torch.tensor(correct),
            "pos_total": torch.tensor(total),
            "accept": torch.tensor(accept),
            "blocks": torch.tensor(blocks),
        }

    tally = Tally(block_size=3)
    tally.add(2.0, 100, stats([0.0, 2.0, 1.0], [0.0, 4.0, 3.0], 7.0, 4.0))
    tally.add(4.0, 50, stats([0.0, 1.0, 0.0], [0.0, 2.0, 2.0], 3.0, 2.0))
    assert tally.all_sum() is tally and (tally.loss, tally.count) == (6.0, 150.0)  # one process: nothing to add
    summary = tally.summary(2)
    assert summary == summarize(stats([0.0, 3.0, 1.0], [0.0, 6.0, 5.0], 10.0, 6.0), 6.0, 2)
    assert summary["loss"] == 3.0 and summary["acc_1"] == 0.5 and summary["tau"] == pytest.approx(10 / 6)


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
