"""jobs/gpu_paper_shapes.py rehearsed at tiny scale on the CPU: every part runs through the pipeline's, the harness's
and the trainer's own code and the JSON holds each figure (the GPU runs the same code at Qwen3-8B's shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_paper_shape_check_at_tiny_scale(tmp_path):
    out = tmp_path / "paper.json"
    cmd = [sys.executable, str(ROOT / "jobs" / "gpu_paper_shapes.py"), "--scale", "tiny", "--device", "cpu"]
    # a bare AdamW: DeepSpeed would build its CPU comm op first (jobs/gpu_smoke.sh runs the check with DeepSpeed)
    cmd += ["--engine", "torch", "--out", str(out), "--repeats", "1", "--regen-prompts", "6"]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["scale"] == "tiny" and figures["shapes"]["drafter_layer_ids"] == [1, 2, 3, 4, 5]
    regen = figures["capture_regenerate"]
    assert regen["prompts"] == 6 and regen["new_tokens"] == 6 * 16, "a random target runs every prompt to the limit"
    assert regen["batch_rows"] == 4 and regen["new_tokens_per_s"] > 0
    prefill = figures["capture_prefill"]
    assert prefill["sequences"] == 8 and prefill["groups"] >= 2 and prefill["tokens_per_s"] > 0
    verify = figures["verify"]
    assert verify["exact"]["verify_equals_steps"] is True and verify["exact"]["verify_ms"] > 0
    train = figures["train"]
    assert train["anchors"] == 16 and train["context_tokens"] == 320 and train["dense"]["step_ms"] > 0
    assert "no backward on a CPU" in train["flex"]["skipped"]
    assert figures["anchor"]["sglang_capture_prefill_tokens_per_s"] == 27000


def test_paper_shapes_are_qwen3_8b_and_its_drafter():
    sys.path.insert(0, str(ROOT / "jobs"))
    try:
        import gpu_paper_shapes as check
    finally:
        sys.path.remove(str(ROOT / "jobs"))
    args = check.parse_args(["--scale", "paper", "--device", "cpu"])
    config = check.target_config(args)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (36, 4096, 12288)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.vocab_size == 151936 and not config.tie_word_embeddings
    spec = check.draft_spec(args)
    assert list(spec.target_layer_ids) == [1, 9, 17, 25, 33] and spec.block_size == 16 and spec.num_draft_layers == 5
    assert (args.anchors, args.max_length) == (512, 3072)
    # Qwen3-8B's published size: 8.2B parameters, 6.95B of them outside the embedding and the head
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 128 + 2 * 4096
    assert round((36 * layer + 4096) / 1e9, 2) == 6.95
    assert round((36 * layer + 4096 + 2 * 151936 * 4096) / 1e9, 1) == 8.2
