#!/usr/bin/env bash
# Smoke run of the whole path on a tiny Qwen3 target built in code (tokenizer too: nothing is downloaded), made for a
# bare GPU machine: its own Python with torch, and flashdraft's other dependencies (transformers too where the
# machine's is older than flashdraft needs) from a small wheelhouse (~44 MiB; no Ray, W&B, datasets or matplotlib)
# installed with no index into the smoke's own folder, ahead of the machine's packages, which it leaves alone.
#   preflight  before anything else: Python >= 3.11, torch >= 2.6 seeing a GPU, transformers >= 5.24 here or in the
#              wheelhouse, a C compiler and the Python headers (Triton builds its launchers with them), and that the
#              wheelhouse satisfies every requirement of what it installs; each thing missing is named with its fix
#   capture    python -m pipeline, in-process (cluster.num_actors=0, no Ray), several fleet tasks in one worker:
#              shards of SHARD_SIZE prompts, a decode batch of CAPTURE_BATCH rows (more than a shard holds, so the
#              next task's prompts join mid-run and the slots grow and shrink at task boundaries), data.overlap=on
#              (the GPU's default, forced on a CPU too), cluster.max_attempts=1 (a failed task fails the smoke
#              instead of being retried quietly)
#   train      python -m trainer under torchrun, one rank per GPU: bf16, FlexAttention, torch.compile, ZeRO-2; then a
#              shorter run with dense attention for the flex-vs-dense step time
#   eval       python -m harness: plain vs dflash, greedy, the lossless check (exact verification where the harness
#              has eval.exact)
#   paper      jobs/gpu_paper_shapes.py: a Qwen3-8B-shaped target and its 5-layer drafter, random weights made on
#              the device: capture tokens/s (regenerate and prefill), a paper-shape training step (flex vs dense),
#              exact vs as-loaded verify cost (PAPER=paper on a GPU, tiny on a CPU, off to skip)
# It writes the figures as JSON (capture tokens/s and settings, step time, flex vs dense, tau, lossless, peak GPU
# memory per stage, wall time per stage, the paper-shape figures) and exits nonzero on a failure, a failed capture
# shard, a failed paper-shape check or a lossy speculative run. Planned to take 7-8 minutes on one H100, not yet run
# on one (the arithmetic: docs/cluster.md).
#
# On a bare GPU node (no index reachable, e.g. an air-gapped compute node):
#   where an index is reachable, in the checkout:  make wheelhouse SET=smoke PYTHON_VERSION=3.12   (the node's Python)
#       -> wheelhouse/cp312-smoke/; copy the checkout with it to the node (tracked files + that folder, ~46 MiB)
#   on the node:  PY=python3 bash jobs/gpu_smoke.sh [RESULT]
# Variables: PY (default .venv/bin/python if present, else python3), WHEELHOUSE (default wheelhouse/cpXY-smoke for
# PY's version; installed from where PY lacks a smoke module or has one older than the wheelhouse's), DEVICE (cuda |
# cpu: the same stages on a CPU, fp32, dense attention, no compile, 2 gloo ranks, smaller), WORK (default a fresh
# /tmp folder; stage logs WORK/<stage>.log), RESULT (default $OUT/gpu_smoke.json where $OUT is set, else
# WORK/gpu_smoke.json), RANKS, PROMPTS (per source, two sources), SHARD_SIZE, CAPTURE_BATCH, STEPS, DENSE_STEPS,
# PAPER (paper | tiny | off), PAPER_ARGS (more arguments for jobs/gpu_paper_shapes.py). No network is used
# (HF_HUB_OFFLINE=1). docs/cluster.md, "A smoke on a bare GPU machine".
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

# logged NAME CMD...: run CMD with its output in WORK/NAME.log and its wall time in WORK/times; on a failure print the
# log's tail and return 1. stage NAME CMD...: the same, stopping the smoke on a failure.
logged() {
    local name=$1 t0; shift
    t0=$(date +%s.%N)
    echo "gpu_smoke: $name" >&2
    if ! "$@" > "$WORK/$name.log" 2>&1; then
        tail -n 40 "$WORK/$name.log" >&2
        echo "gpu_smoke: $name failed (log: $WORK/$name.log)" >&2
        return 1
    fi
    echo "$name $(awk "BEGIN { print $(date +%s.%N) - $t0 }")" >> "$WORK/times"
}
stage() { logged "$@" || exit 1; }
# has_setting CLASS FIELD: whether this checkout's flashdraft.config.CLASS has the setting FIELD.
has_setting() {
    "$PY" -c "import sys; from flashdraft import config; sys.exit('$2' not in config.$1.__dataclass_fields__)"
}

# The Python floor first, in bash: an older Python may not even run the checks below.
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "gpu_smoke: MISSING: $("$PY" -V 2>&1 || echo "no Python") at $PY: flashdraft needs Python >= 3.11 (PY=...)" >&2
    exit 1
fi
PYV=$("$PY" -c 'import sys; print(f"{sys.version_info.major}{sys.version_info.minor}")')
WHEELHOUSE=${WHEELHOUSE:-$ROOT/wheelhouse/cp$PYV-smoke}
if ! "$PY" jobs/gpu_smoke.py preflight "$DEVICE" "$WHEELHOUSE" "$WORK/install-plan"; then
    echo "gpu_smoke: the machine lacks what is named above; nothing was run" >&2
    exit 1
fi
if [[ -s "$WORK/install-plan" ]]; then  # the smoke's own site folder, ahead of the machine's site-packages
    stage install "$PY" jobs/gpu_smoke.py install "$WHEELHOUSE" "$WORK/site"
    export PYTHONPATH=$PYTHONPATH:$WORK/site
fi

if [[ "$DEVICE" == cuda ]]; then
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    RANKS=${RANKS:-$GPUS} PROMPTS=${PROMPTS:-48} STEPS=${STEPS:-300} DENSE_STEPS=${DENSE_STEPS:-60}
    SHARD_SIZE=${SHARD_SIZE:-4} CAPTURE_BATCH=${CAPTURE_BATCH:-6} PAPER=${PAPER:-paper}
    DTYPE=bfloat16
    TRAIN=(train.compile=true train.num_anchors=32 train.token_budget=8192)
    ATTENTION=flex
    EVAL=(eval.limit=4 eval.max_new_tokens=64)
else
    RANKS=${RANKS:-2} PROMPTS=${PROMPTS:-4} STEPS=${STEPS:-8} DENSE_STEPS=0
    SHARD_SIZE=${SHARD_SIZE:-2} CAPTURE_BATCH=${CAPTURE_BATCH:-3} PAPER=${PAPER:-tiny}
    DTYPE=float32
    TRAIN=(train.compile=false)
    ATTENTION=dense
    EVAL=(eval.limit=1 eval.max_new_tokens=32 eval.warmup=false eval.turns=single)
fi
# Several tasks in one worker, a batch larger than a task's prompts: the next task's prompts join mid-run, and the
# slots grow and shrink at task boundaries; with overlap on, on every device (where this checkout has the setting).
CAPTURE=(data.shard_size="$SHARD_SIZE" data.batch_size="$CAPTURE_BATCH" cluster.max_attempts=1)
OVERLAP=unavailable
if has_setting DataConfig overlap; then
    CAPTURE+=(data.overlap=on)
    OVERLAP=on
fi
printf '{"prompts": %d, "shard_size": %d, "batch_size": %d, "tasks": %d, "overlap": "%s", "max_attempts": 1}\n' \
    $((2 * PROMPTS)) "$SHARD_SIZE" "$CAPTURE_BATCH" $(((2 * PROMPTS + SHARD_SIZE - 1) / SHARD_SIZE)) "$OVERLAP" \
    > "$WORK/capture-settings.json"
# The harness's exact verification, where it has the setting (greedy plain and speculative decoding then take the
# same kernels on any device).
if has_setting EvalConfig exact; then
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
    "$SOURCES" data.limit="$PROMPTS" data.max_new_tokens=64 "${CAPTURE[@]}"
stage train "${TORCHRUN[@]}" stage train "$WORK" -m trainer "${TRAIN[@]}" train.attention=$ATTENTION \
    train.max_steps="$STEPS"
if (( DENSE_STEPS > 0 )); then
    stage train_dense "${TORCHRUN[@]}" stage train_dense "$WORK" -m trainer "${TRAIN[@]}" train.attention=dense \
        train.max_steps="$DENSE_STEPS" train.out_dir="$WORK/run/train-dense" train.drafter_dir="$WORK/run/drafter-dense"
fi
stage eval "$PY" jobs/gpu_smoke.py stage eval "$WORK" -m harness "${RUN[@]}" "${EVAL[@]}" \
    "eval.prompts=[pydocs,chatseeds]" "eval.methods=[plain,dflash]" eval.allow_untrained=false
# The paper-shape check last, in its own process (the GPU's memory is free again); its failure is reported in the
# JSON with the other figures, and fails the smoke.
if [[ "$PAPER" != off ]]; then
    # shellcheck disable=SC2086  # PAPER_ARGS: several arguments
    logged paper "$PY" jobs/gpu_paper_shapes.py --scale "$PAPER" --device "$DEVICE" --out "$WORK/paper_shapes.json" \
        ${PAPER_ARGS:-} || true
fi
"$PY" jobs/gpu_smoke.py report "$WORK" "$RESULT" "$DEVICE"
