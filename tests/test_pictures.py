"""Eval pictures (acceptance histograms, training curves), the metrics.jsonl reader, train/serve parity and
their place in report.md: tiny fake data in tmp_path, no model."""

import json

import pytest

from harness.pictures import acceptance_lengths_by_source, plot_acceptance, plot_training, running_mean
from harness.report import methods_table, render_markdown
from harness.training_log import CUTOFF_REASON, PARITY_REASONS, last_eval_tau, read_metrics, train_serve_parity

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_metrics(path, steps=30, eval_every=10):
    rows = []
    for step in range(1, steps + 1):
        rows.append({"step": step, "loss": 20 / step + 4, "tau": 1 + step / 100, "acc": step / 200, "lr": 1e-4})
        if step % eval_every == 0:
            rows.append({"step": step, "eval/loss": 5 - step / 100, "eval/tau": 1 + step / 50, "eval/acc": 0.1})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 31, "lo')  # a trainer killed mid-write
    return rows


def fake_records():
    dflash = {"humaneval": [[1, 3, 4, 1], [2, 1]], "mtbench": [[1, 1, 2], [1]]}
    lookup = {"humaneval": [[1, 11, 2], [1]], "mtbench": [[1, 1], [1, 3]]}
    return [
        {
            "source": source,
            "record_id": f"{source}/{i}",
            "methods": {
                "plain": {"acceptance_lengths": [1] * 5},
                "dflash": {"acceptance_lengths": d},
                "prompt_lookup": {"acceptance_lengths": p},
            },
        }
        for source in dflash
        for i, (d, p) in enumerate(zip(dflash[source], lookup[source]))
    ]


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, (path, len(data))


def test_metrics_reader_and_parity(tmp_path):
    rows = fake_metrics(tmp_path / "metrics.jsonl")
    read = read_metrics(tmp_path / "metrics.jsonl")
    assert read == rows  # the truncated last line is skipped
    assert last_eval_tau(read) == (30, 1.6)
    assert read_metrics(tmp_path / "absent.jsonl") is None and last_eval_tau(None) is None
    assert last_eval_tau([r for r in rows if "loss" in r]) is None  # no held-out eval logged yet

    close = train_serve_parity(read, 1.55)
    assert close["offline_tau"] == 1.6 and close["offline_step"] == 30 and close["served_tau"] == 1.55
    assert close["relative_gap"] == pytest.approx(-0.05 / 1.6) and close["explanation"] is None
    far = train_serve_parity(read, 1.2)
    assert far["relative_gap"] == pytest.approx(-0.25) and far["explanation"] == PARITY_REASONS
    assert train_serve_parity(None, 1.2) is None and train_serve_parity(read, None) is None
    cut = train_serve_parity(read, 1.2, draft_cutoff=0.1)  # served verified only prefixes: said so
    assert cut["explanation"] == PARITY_REASONS + " " + CUTOFF_REASON


def test_acceptance_picture(tmp_path):
    lengths = acceptance_lengths_by_source(fake_records())
    assert lengths["humaneval"] == {"dflash": [1, 3, 4, 1, 2, 1], "prompt_lookup": [1, 11, 2, 1]}
    assert list(lengths) == ["humaneval", "mtbench"] and "plain" not in lengths["mtbench"]
    path = plot_acceptance(lengths, 8, tmp_path / "out" / "acceptance.png")
    assert path == tmp_path / "out" / "acceptance.png"
    assert_png(path)
    only_dflash = plot_acceptance(acceptance_lengths_by_source(fake_records(), ("dflash",)), 4, tmp_path / "d.png")
    assert_png(only_dflash)
    assert plot_acceptance({"humaneval": {"dflash": []}}, 4, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_training_picture(tmp_path):
    rows = fake_metrics(tmp_path / "metrics.jsonl")
    assert_png(plot_training(rows, tmp_path / "training.png", served_tau=1.3))
    assert_png(plot_training([r for r in rows if "eval/tau" in r], tmp_path / "eval_only.png"))
    assert plot_training([], tmp_path / "empty.png") is None
    assert running_mean([1, 3, 5, 7], 2).tolist() == [1, 2, 4, 6]


def minimal_report(**extra):
    summary = {
        "tau": 2.0,
        "tokens_per_s": 10.0,
        "speedup": 1.5,
        "lossless": True,
        "decode_tokens": 8,
        "decode_s": 0.8,
        "rounds": 4,
        "acceptance_histogram": {"1": 2, "2": 0, "3": 2},
        "round_ms": {"draft": 1.0, "verify": 2.0, "bookkeeping": 0.1},
    }
    settings = {
        "untrained_drafter": False,
        "target": "t",
        "drafter": "d",
        "prompt_counts": {"humaneval": 1},
        "split": "heldout",
        "limit": 1,
        "max_new_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "block_size": 3,
        "prompt_lookup_num_tokens": 10,
        "device": "cpu",
        "dtype": "float32",
        "torch": "x",
        "transformers": "y",
        "torch_threads": 1,
        "date": "today",
    }
    return {"settings": settings, "methods": {"dflash": {**summary, "by_source": {"humaneval": summary}}}, **extra}


def test_report_links_pictures_and_shows_parity(tmp_path):
    rows = fake_metrics(tmp_path / "metrics.jsonl")
    parity = {**train_serve_parity(rows, 1.2), "metrics": "runs/x/train/metrics.jsonl"}
    md = render_markdown(
        minimal_report(pictures={"acceptance": "acceptance.png", "training": "training.png"}, train_serve_parity=parity)
    )
    assert "](acceptance.png)" in md and "](training.png)" in md
    assert (
        "step 30" in md
        and "| 1.600 | - | 1.200 | -25.0% |" in md
        and PARITY_REASONS in md
        and "runs/x/train/metrics.jsonl" in md
    )
    replayed = {**train_serve_parity(rows, 1.2, replay={"tau": 1.25, "prompts": 1}), "metrics": "m"}
    md = render_markdown(minimal_report(pictures={}, train_serve_parity=replayed))
    assert "| 1.600 | 1.250 | 1.200 | -25.0% |" in md and "block starts account for -21.9%" in md and "for -4.0%" in md
    plain = render_markdown(minimal_report())  # a report from before pictures, or with none drawn
    assert ".png" not in plain and "parity" not in plain


def test_methods_table_marks_missing_speedup_without_a_stray_x():
    row = {"tau": 2.0, "tokens_per_s": 10.0, "lossless": None, "decode_tokens": 8, "decode_s": 0.8}
    table = methods_table({"dflash": {**row, "speedup": 1.5}, "dflash_tree": {**row, "speedup": None}})
    assert "| dflash | 2.00 |  | 10.00 | 1.50x | n/a |" in table  # no break-even tau (an older report): blank
    assert "| dflash_tree | 2.00 |  | 10.00 | n/a | n/a |" in table and "n/ax" not in table
