# shellcheck shell=bash
# Shared helpers for the Slurm scripts. DRY_RUN=1 prints each node's command instead of running it.
set -euo pipefail

FLASHDRAFT_ROOT=${FLASHDRAFT_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PY=${PY:-$FLASHDRAFT_ROOT/.venv/bin/python}
RAY=${RAY:-$FLASHDRAFT_ROOT/.venv/bin/ray}
STEPS=()  # the pids of the srun steps started by on_node

dry() { [[ "${DRY_RUN:-0}" == 1 ]]; }

# The allocation's node names, one per line (scontrol; a DRY_RUN without Slurm reads a plain comma list).
hostnames() {
    : "${SLURM_JOB_NODELIST:?not in a Slurm job: submit with sbatch (or DRY_RUN=1 SLURM_JOB_NODELIST=n1,n2)}"
    scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null && return
    dry || { echo "scontrol show hostnames $SLURM_JOB_NODELIST failed" >&2; return 1; }
    echo "$SLURM_JOB_NODELIST" | tr ',' '\n'
}

# job_nodes: the allocation's node names into the array NODES.
job_nodes() {
    mapfile -t NODES < <(hostnames)
    ((${#NODES[@]} > 0)) || { echo "no nodes in SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-}" >&2; exit 1; }
}

# node_addr NODE: the IPv4 address of a node as Slurm knows it (its NodeAddr, resolved if it is a host name).
# Node names need not resolve (NodeName=n1 NodeAddr=10.0.0.5). DRY_RUN prints the name.
node_addr() {
    dry && { echo "$1"; return; }
    local addr
    addr=$(scontrol show node "$1" -o | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
    [[ -n $addr ]] || { echo "no NodeAddr for node $1 in 'scontrol show node $1'" >&2; return 1; }
    getent ahostsv4 "$addr" | awk 'NR == 1 { print $1; found = 1 } END { exit !found }' \
        || { echo "node $1: NodeAddr $addr does not resolve to an IPv4 address" >&2; return 1; }
}

# ray_addr NODE: the address Ray takes for NODE given `ray start --node-ip-address=$(node_addr NODE)`. Ray replaces
# 127.0.0.1 by this machine's own address (ray._private.services.resolve_ip_for_localhost, which `ray start` calls):
# asking Ray the same keeps the head address the scripts name and connect to the one Ray prints.
ray_addr() {
    local addr
    addr=$(node_addr "$1") || return 1
    if ! dry && [[ $addr == 127.* ]]; then
        local ask='import sys; from ray._private.services import resolve_ip_for_localhost as r; print(r(sys.argv[1]))'
        addr=$("$PY" -c "$ask" "$addr" 2>/dev/null) || addr=$(node_addr "$1")
    fi
    echo "$addr"
}

# gpus_per_node: GPUS_PER_NODE, else the GPUs Slurm gave this node, else the GPUs nvidia-smi lists, else 0 (CPU).
gpus_per_node() {
    if [[ -n "${GPUS_PER_NODE:-}" ]]; then
        echo "$GPUS_PER_NODE"
    elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        echo "$SLURM_GPUS_ON_NODE"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L | grep -c '^GPU' || true
    else
        echo 0
    fi
}

# on_node HOST CMD...: run CMD on HOST through srun (one task, the job's CPUs per task) in the background,
# or print it under DRY_RUN. Slurm 22.05-23.02 steps do not inherit --cpus-per-task: it is passed explicitly.
on_node() {
    local host=$1
    shift
    if dry; then
        echo "[$host] $*"
    else
        srun --nodes=1 --ntasks=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} -w "$host" "$@" &
        STEPS+=($!)
    fi
}

# wait_steps: wait for every on_node step; when one fails, stop the others and fail with its exit code.
wait_steps() {
    local _ rc
    for _ in "${STEPS[@]}"; do
        wait -n || { rc=$?; echo "a step failed (exit $rc): stopping the others" >&2; stop_steps; return "$rc"; }
    done
    STEPS=()
}

# steps_alive any|all: whether any (all) of the on_node steps still run.
steps_alive() {
    local pid
    for pid in "${STEPS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then [[ $1 == any ]] && return 0; else [[ $1 == all ]] && return 1; fi
    done
    [[ $1 == all ]]
}

# stop_steps: end the on_node steps still running: TERM to the job's steps (not this script), KILL after 30 s.
stop_steps() {
    local pid _
    ((${#STEPS[@]})) || return 0
    echo "stopping the job's steps (scancel --signal=TERM: slurmstepd logs each as CANCELLED)"
    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
    for _ in $(seq 30); do steps_alive any || break; sleep 1; done
    for pid in "${STEPS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${STEPS[@]}"; do wait "$pid" 2>/dev/null || true; done
    STEPS=()
}

# on_node_until_stopped HOST CMD...: on_node, for a CMD that runs until stop_steps ends it (`ray start --block`):
# jobs/until_stopped.sh makes that stop read as success, so a completed job's log shows no failed step.
on_node_until_stopped() {
    local host=$1
    shift
    on_node "$host" bash "$FLASHDRAFT_ROOT/jobs/until_stopped.sh" "$@"
}

# here CMD...: run CMD on this (the batch) node, or print it under DRY_RUN.
here() {
    if dry; then
        echo "[$([[ -n ${SLURM_JOB_NODELIST:-} ]] && hostnames | head -n1 || echo here)] $*"
    else
        "$@"
    fi
}

# ray_nodes ADDRESS: how many nodes the Ray cluster at ADDRESS has up (0 when it does not answer): the sum of the
# " <count> <node type>" lines under Active: and Idle: in `ray status`.
ray_nodes() {
    { "$RAY" status --address="$1" 2>/dev/null || true; } | awk '
        /^(Active|Idle):/ { on = 1; next }
        /^Pending:/ { on = 0 }
        on && $1 ~ /^[0-9]+$/ { n += $1 }
        END { print n + 0 }'
}

# wait_ray ADDRESS N: wait until the Ray cluster at ADDRESS has N nodes up (RAY_WAIT_S, default 300 s), or fail.
wait_ray() {
    dry && return
    local deadline=$((SECONDS + ${RAY_WAIT_S:-300})) up=0
    while ((SECONDS < deadline)); do
        up=$(ray_nodes "$1")
        ((up >= $2)) && { echo "Ray at $1: $up/$2 nodes up"; return; }
        steps_alive all || { echo "a Ray node's srun step exited (see above) while waiting for $1" >&2; return 1; }
        sleep 3
    done
    echo "Ray at $1: $up/$2 nodes up after ${RAY_WAIT_S:-300} s (RAY_WAIT_S); see the ray start output above" >&2
    return 1
}
