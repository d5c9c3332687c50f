#!/usr/bin/env bash
# Smoke run of the whole path on a tiny Qwen3 target built in code (tokenizer too: nothing is downloaded), made for a
# bare GPU machine: its own Python with torch and transformers, and none of flashdraft's other dependencies, which
# come from a small wheelhouse (~30 MiB; no Ray, W&B, datasets or matplotlib) installed with no index.
#   capture  python -m pipeline, in-process (cluster.num_actors=0, no Ray), the decode batch sized by free memory
#   train    python -m trainer under torchrun, one rank per GPU: bf16, FlexAttention, torch.compile, ZeRO-2; then a
#            shorter run with dense attention for the flex-vs-dense step time
#   eval     python -m harness: plain vs dflash, greedy, the lossless check (exact verification where the harness
#            has eval.exact)
# It writes the figures as JSON (capture tokens/s, step time, flex vs dense, tau, lossless, peak GPU memory per
# stage, wall time per stage) and exits nonzero on a failure or a lossy speculative run.
#
# On a bare GPU node (no index reachable, e.g. an air-gapped compute node):
#   where an index is reachable, in the checkout:  make wheelhouse SET=smoke PYTHON_VERSION=3.12   (the node's Python)
#       -> wheelhouse/cp312-smoke/; copy the checkout with it to the node (tracked files + that folder, ~32 MiB)
#   on the node:  PY=python3 bash jobs/gpu_smoke.sh [RESULT]
# Variables: PY (default .venv/bin/python if present, else python3), WHEELHOUSE (default wheelhouse/cpXY-smoke for
# PY's version; used only where PY cannot import the smoke's modules), DEVICE (cuda | cpu: the same stages on a CPU,
# fp32, dense attention, no compile, 2 gloo ranks, smaller), WORK (default a fresh /tmp folder; stage logs
# WORK/<stage>.log), RESULT (default $OUT/gpu_smoke.json where $OUT is set, else WORK/gpu_smoke.json), RANKS, PROMPTS,
# STEPS, DENSE_STEPS. No network is used (HF_HUB_OFFLINE=1). docs/cluster.md, "A smoke on a bare GPU machine".
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PY:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-$(mktemp -d /tmp/gpu-smoke.XXXXXX)}
RESULT=${1:-${OUT:+$OUT/gpu_smoke.json}}
RESULT=${RESULT:-$WORK/gpu_smoke.json}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
# DeepSpeed's JIT-built ops (its CPU comm op) in the work folder: a build for another torch, or a lock left by a killed
# build, in the user's cache cannot stall the smoke.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$WORK/torch_extensions}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
cd "$ROOT"
mkdir -p "$WORK" "$(dirname "$RESULT")"
: > "$WORK/times"

# stage NAME CMD...: run CMD with its output in WORK/NAME.log and its wall time in WORK/times; stop on a failure.
stage() {
    local name=$1 t0; shift
    t0=$(date +%s.%N)
    echo "gpu_smoke: $name" >&2
    if ! "$@" > "$WORK/$name.log" 2>&1; then
        tail -n 40 "$WORK/$name.log" >&2
        echo "gpu_smoke: $name failed (log: $WORK/$name.log)" >&2
        exit 1
    fi
    echo "$name $(awk "BEGIN { print $(date +%s.%N) - $t0 }")" >> "$WORK/times"
}

if ! "$PY" -c "import zarr, numcodecs, deepspeed, hydra" 2>/dev/null; then
    PYV=$("$PY" -c 'import sys; print(f"{sys.version_info.major}{sys.version_info.minor}")')
    WHEELHOUSE=${WHEELHOUSE:-$ROOT/wheelhouse/cp$PYV-smoke}
    stage install "$PY" jobs/gpu_smoke.py install "$WHEELHOUSE" "$WORK/site"
    export PYTHONPATH=$PYTHONPATH:$WORK/site
fi

if [[ "$DEVICE" == cuda ]]; then
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    (( GPUS > 0 )) || { echo "gpu_smoke: $PY sees no GPU (DEVICE=cpu runs the CPU fallback)" >&2; exit 1; }
    RANKS=${RANKS:-$GPUS} PROMPTS=${PROMPTS:-48} STEPS=${STEPS:-300} DENSE_STEPS=${DENSE_STEPS:-60}
    DTYPE=bfloat16
    CAPTURE=()
    TRAIN=(train.compile=true train.num_anchors=32 train.token_budget=8192)
    ATTENTION=flex
    EVAL=(eval.limit=4 eval.max_new_tokens=64)
else
    RANKS=${RANKS:-2} PROMPTS=${PROMPTS:-4} STEPS=${STEPS:-8} DENSE_STEPS=0
    DTYPE=float32
    CAPTURE=()
    TRAIN=(train.compile=false)
    ATTENTION=dense
    EVAL=(eval.limit=1 eval.max_new_tokens=32 eval.warmup=false eval.turns=single)
fi
# The harness's exact verification, where it has the setting (greedy plain and speculative decoding then take the
# same kernels on any device).
if "$PY" -c "import sys; from flashdraft.config import EvalConfig; sys.exit('exact' not in EvalConfig.__dataclass_fields__)"; then
    EVAL+=(eval.exact=on)
fi
echo "$RANKS" > "$WORK/ranks"
RUN=(model.target="$WORK/target" "drafter.layer_ids=[1,3,5]" model.dtype="$DTYPE" run_dir="$WORK/run" device="$DEVICE")
TRAIN+=("${RUN[@]}" train.dtype="$DTYPE" train.zero_stage=2 train.epochs=1000 train.eval_every=0
    train.checkpoint_every=0 train.progress=false drafter.num_layers=2 drafter.block_size=8)
SOURCES="data.sources=[pydocs,chatseeds]"
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node="$RANKS" jobs/gpu_smoke.py)

stage target "$PY" jobs/gpu_smoke.py target "$WORK/target"
stage capture "$PY" jobs/gpu_smoke.py stage capture "$WORK" -m pipeline "${RUN[@]}" cluster.num_actors=0 \
    "$SOURCES" data.limit="$PROMPTS" data.max_new_tokens=64 data.shard_size=16 "${CAPTURE[@]}"
stage train "${TORCHRUN[@]}" stage train "$WORK" -m trainer "${TRAIN[@]}" train.attention=$ATTENTION \
    train.max_steps="$STEPS"
if (( DENSE_STEPS > 0 )); then
    stage train_dense "${TORCHRUN[@]}" stage train_dense "$WORK" -m trainer "${TRAIN[@]}" train.attention=dense \
        train.max_steps="$DENSE_STEPS" train.out_dir="$WORK/run/train-dense" train.drafter_dir="$WORK/run/drafter-dense"
fi
stage eval "$PY" jobs/gpu_smoke.py stage eval "$WORK" -m harness "${RUN[@]}" "${EVAL[@]}" \
    "eval.prompts=[pydocs,chatseeds]" "eval.methods=[plain,dflash]" eval.allow_untrained=false
"$PY" jobs/gpu_smoke.py report "$WORK" "$RESULT" "$DEVICE"
