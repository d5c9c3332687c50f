#!/usr/bin/env bash
# GPU smoke run of the whole path on a tiny Qwen3 target built in code, in about 5 minutes on one H100:
# capture (pipeline, one Ray capture actor on a GPU) -> train (bf16, FlexAttention, torch.compile, ZeRO-2; torchrun
# with 2 ranks where 2 GPUs exist, else 1) -> eval (harness: plain vs dflash, lossless check). Writes its figures
# (steps/s, tokens/s, loss, tau, lossless, wall time per stage, GPU name) as JSON and exits nonzero on a failure.
#   bash jobs/gpu_smoke.sh [RESULT]       # RESULT: default $OUT/gpu_smoke.json where $OUT is set, else WORK/gpu_smoke.json
#   PY=python3 bash jobs/gpu_smoke.sh     # another environment's python (it needs CUDA torch and pyproject's packages)
#   DEVICE=cpu bash jobs/gpu_smoke.sh     # the same stages on a CPU (fp32, dense attention, no compile), smaller
# No network is used (HF_HUB_OFFLINE=1). Stage logs: WORK/<stage>.log (WORK: a fresh /tmp folder unless given).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-$(mktemp -d /tmp/gpu-smoke.XXXXXX)}
RESULT=${1:-${OUT:+$OUT/gpu_smoke.json}}
RESULT=${RESULT:-$WORK/gpu_smoke.json}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
cd "$ROOT"
mkdir -p "$WORK" "$(dirname "$RESULT")"
: > "$WORK/times"

if [[ "$DEVICE" == cuda ]]; then
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    (( GPUS > 0 )) || { echo "gpu_smoke: $PY sees no GPU (DEVICE=cpu runs the CPU fallback)" >&2; exit 1; }
    RANKS=${RANKS:-$(( GPUS >= 2 ? 2 : 1 ))} PROMPTS=${PROMPTS:-48} STEPS=${STEPS:-300}
    DTYPE=bfloat16 GPUS_PER_ACTOR=1
    TRAIN=(train.attention=flex train.compile=true train.num_anchors=32 train.token_budget=8192)
    EVAL=(eval.limit=4 eval.max_new_tokens=64)
else
    RANKS=${RANKS:-2} PROMPTS=${PROMPTS:-4} STEPS=${STEPS:-8}
    DTYPE=float32 GPUS_PER_ACTOR=0
    TRAIN=(train.attention=dense train.compile=false)
    EVAL=(eval.limit=1 eval.max_new_tokens=32 eval.warmup=false)
fi
echo "$RANKS" > "$WORK/ranks"
RUN=(model.target="$WORK/target" "drafter.layer_ids=[1,3,5]" model.dtype="$DTYPE" run_dir="$WORK/run" device="$DEVICE")

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

stage target "$PY" jobs/gpu_smoke.py target "$WORK/target"
stage capture "$PY" -m pipeline "${RUN[@]}" cluster.num_actors=1 cluster.gpus_per_actor="$GPUS_PER_ACTOR" \
    "data.sources=[humaneval,mtbench]" data.limit="$PROMPTS" data.max_new_tokens=64 data.shard_size=16 data.batch_size=16
stage train "$PY" -m torch.distributed.run --standalone --nproc-per-node="$RANKS" -m trainer "${RUN[@]}" "${TRAIN[@]}" \
    train.dtype="$DTYPE" train.zero_stage=2 train.max_steps="$STEPS" train.epochs=1000 train.eval_every=0 \
    train.checkpoint_every=0 train.progress=false drafter.num_layers=2 drafter.block_size=8
stage eval "$PY" -m harness "${RUN[@]}" "${EVAL[@]}" "eval.methods=[plain,dflash]" eval.allow_untrained=false
"$PY" jobs/gpu_smoke.py report "$WORK" "$RESULT" "$DEVICE"
