"""python -m harness draws acceptance.png and training.png next to report.md and reports train/serve parity,
on the tiny target of test_harness_cli with a trained-format drafter and a fake trainer metrics.jsonl."""

import json

from harness.__main__ import run
from tests.test_harness_cli import eval_settings, overrides, target_dir, write_training_store  # noqa: F401 (target_dir: fixture)
from tests.test_pictures import PNG_MAGIC, fake_metrics
from tests.test_speculative import one_thread, tiny_drafter, tiny_target  # noqa: F401 (one_thread: autouse fixture)


def test_eval_writes_pictures_and_parity(target_dir, tmp_path, capsys):  # noqa: F811 (target_dir: the fixture)
    tiny_drafter(tiny_target("llama", vocab=320), block_size=4, mask_token_id=310, layers=1).save_pretrained(
        tmp_path / "drafter"
    )
    (tmp_path / "train").mkdir()
    fake_metrics(tmp_path / "train" / "metrics.jsonl")  # last eval/tau 1.6 at step 30
    write_training_store(tmp_path / "features", target_dir, "none")
    cfg = eval_settings(
        overrides(
            target_dir, tmp_path, f"eval.drafter={tmp_path / 'drafter'}", "eval.allow_untrained=false", "eval.limit=1"
        )
    )
    assert cfg.eval.metrics == f"{tmp_path}/train/metrics.jsonl"
    report = run(cfg)
    out = tmp_path / "eval"
    assert report["pictures"] == {"acceptance": "acceptance.png", "training": "training.png"}
    for name in report["pictures"].values():
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    parity = json.loads((out / "report.json").read_text())["train_serve_parity"]
    assert parity["offline_tau"] == 1.6 and parity["offline_step"] == 30
    assert parity["served_tau"] == report["methods"]["dflash"]["tau"]
    md = (out / "report.md").read_text()
    assert "![Acceptance length per prompt set](acceptance.png)" in md and "](training.png)" in md and "step 30" in md
    assert "train/serve parity: offline tau 1.600" in capsys.readouterr().out

    (
        tmp_path / "train" / "metrics.jsonl"
    ).unlink()  # no trainer log: no training picture (the old one is removed), no parity
    report = run(cfg)
    assert report["pictures"] == {"acceptance": "acceptance.png"} and report["train_serve_parity"] is None
    assert not (out / "training.png").exists() and "training.png skipped" in capsys.readouterr().out
