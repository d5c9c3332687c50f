"""`python -m pipeline estimate` without the hub: hub sources at their figures in conf/, and the files a shard holds."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flashdraft.config import source_figures
from flashdraft.store import StoreLayout, dirs_per_shard, files_per_shard, write_store
from tests.test_store import make_sequences, small

ROOT = Path(__file__).resolve().parents[1]


def estimate(tmp_path, *overrides):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pipeline", "estimate", "model=qwen3-8b", f"run_dir={tmp_path}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    """`estimate model=qwen3-8b data=nemotron`, run once for the tests that read its output."""
    return estimate(tmp_path_factory.mktemp("estimate"), "data=nemotron")


def number(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text}"
    return float(m.group(1).replace(",", ""))


def test_offline_estimate_of_nemotron_follows_the_conf_figures(nemotron):
    r = nemotron
    out = r.stdout
    assert r.returncode in (0, 1), r.stderr
    assert ("DOES NOT FIT" in out) == (r.returncode == 1)
    conf = yaml.safe_load((ROOT / "conf/data/nemotron.yaml").read_text())
    figures = conf["figures"]
    assert sorted(figures) == sorted(conf["sources"]) and all(f["source"] for f in figures.values())
    # the same arithmetic by hand: the train split (0.8 of each source), responses capped at max_new_tokens 2048,
    # 5 layers of 4096 bf16 (2 bytes) or fp8 (1 byte + a 4-byte scale), + an int32 id and a bool mask a token
    prompts = tokens = 0
    for source, f in figures.items():
        n = round(f["samples"] * 0.8)
        per_seq = min(3072, f["prompt_tokens"] + min(f["response_tokens"], 2048))
        assert number(out, rf"{source}: ([\d,]+) prompts") == n
        prompts, tokens = prompts + n, tokens + int(n * per_seq)
    assert number(out, r"= ([\d,]+) prompts") == prompts
    assert number(out, r"prompts \(train split\), ([\d,]+) tokens") == tokens
    bf16, fp8 = 5 * 4096 * 2 + 5, 5 * (4096 + 4) + 5
    assert number(out, r"bfloat16 +([\d,]+) bytes/token") == bf16
    assert number(out, r"float8_e4m3 +([\d,]+) bytes/token") == fp8
    assert number(out, r"bfloat16 .*bytes/token = ([\d.,]+) TB") == round(tokens * bf16 / 1e12, 2)
    assert number(out, r"float8_e4m3 .*bytes/token = ([\d.,]+) TB") == round(tokens * fp8 / 1e12, 2)
    shards = math.ceil(prompts / 256)
    assert number(out, r"shards: ([\d,]+)") == shards
    for dtype, arrays in (("bfloat16", 3), ("float8_e4m3", 4)):  # ids, mask, features (+ fp8 scales)
        assert number(out, rf"files \({dtype}\): ([\d,]+) a shard") == 1 + 2 * arrays
        assert number(out, rf"files \({dtype}\): .* = ([\d,]+) in all") == shards * (1 + 2 * arrays)
    assert number(out, r"GPU-hours: ([\d,]+) at data.capture_tokens_per_s 250 ") == round(tokens / 250 / 3600)
    assert "is an assumption" in out  # the default rate says so


def test_the_capture_rate_and_response_length_are_settings(tmp_path):
    r = estimate(tmp_path, "data=nemotron", "data.capture_tokens_per_s=5000", "data.expected_response_tokens=500")
    tokens = number(r.stdout, r"prompts \(train split\), ([\d,]+) tokens")
    assert number(r.stdout, r"mean [\d,]+ prompt \+ ([\d,]+) response") == 500
    assert number(r.stdout, r"GPU-hours: ([\d,]+) at data.capture_tokens_per_s 5000 ") == round(tokens / 5000 / 3600)
    assert "is an assumption" not in r.stdout


def test_a_source_without_figures_is_named_with_what_to_pass(tmp_path):
    r = estimate(tmp_path, "data=nemotron", "data.sources=[nemotron-v2-math,gsm8k]")
    assert r.returncode == 1 and "gsm8k" in r.stderr and "+data.figures.gsm8k=" in r.stderr, r.stderr
    r = estimate(
        tmp_path,
        "data=nemotron",
        "data.sources=[gsm8k]",
        "+data.figures.gsm8k={samples: 1000, prompt_tokens: 100, response_tokens: 200, source: mine}",
    )
    assert r.returncode in (0, 1) and "gsm8k: 800 prompts x (100 prompt + 200 response)" in r.stdout, r.stderr


def test_source_figures_refuses_unknown_and_missing_fields():
    ok = {"samples": 10, "prompt_tokens": 5, "response_tokens": 7, "source": "assumption"}
    assert source_figures({"x": ok})["x"].samples == 10
    with pytest.raises(ValueError, match="data.figures.x.*lacks.*source"):
        source_figures({"x": {k: v for k, v in ok.items() if k != "source"}})
    with pytest.raises(ValueError, match="samplez"):
        source_figures({"x": {**ok, "samplez": 1}})


@pytest.mark.parametrize("dtype,topk", [("bfloat16", 0), ("float8_e4m3", 0), ("bfloat16", 4)])
def test_files_per_shard_counts_a_real_shard(tmp_path, dtype, topk):
    seqs = make_sequences()
    for s in seqs if topk else ():
        n = len(s["input_ids"])
        s["teacher"] = (torch.zeros(n, topk, dtype=torch.long), torch.full((n, topk), -1.0))
    layout = dict(small(dtype), teacher_topk=topk)
    write_store(tmp_path / "s", seqs, **layout)
    shard = tmp_path / "s" / "shards" / "shard-00000"
    files = sum(len(f) for _, _, f in os.walk(shard))
    dirs = sum(len(d) for _, d, _ in os.walk(shard))
    lay = StoreLayout(tuple(layout.pop("layer_ids")), layout.pop("hidden_size"), **layout)
    assert (files_per_shard(lay), dirs_per_shard(lay)) == (files, dirs)


def test_the_estimate_prints_every_projected_option(nemotron):
    """Issue #47: r = H, 2H, 2.5H features a token (one fp8 scale a token), in bf16 and fp8, beside the raw sizes."""
    r = nemotron
    out = r.stdout
    assert r.returncode in (0, 1), r.stderr
    tokens = number(out, r"prompts \(train split\), ([\d,]+) tokens")
    for label, dims in (("H", 4096), ("2H", 8192), ("2.5H", 10240)):
        for dtype, per in (("bfloat16", 2 * dims + 5), ("float8_e4m3", dims + 4 + 5)):
            row = rf"r={re.escape(label)} \({dims:,}\) +{dtype} +([\d,]+) bytes/token"
            assert number(out, row) == per
            assert number(out, row.replace(r"([\d,]+) bytes/token", r"[\d,]+ bytes/token = ([\d.,]+) TB")) == round(
                tokens * per / 1e12, 2
            )
    # the paper job (qwen3-8b, nemotron): 63.41 TB in bf16, 12.69 TB at r = H in bf16, 6.35 TB in fp8
    assert number(out, r"r=H \(4,096\) +float8_e4m3 .* = ([\d.,]+) TB") == 6.35
