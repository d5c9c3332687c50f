# Shared helpers for the Slurm scripts. DRY_RUN=1 prints each node's command instead of running it.
set -euo pipefail

FLASHDRAFT_ROOT=${FLASHDRAFT_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PY=${PY:-$FLASHDRAFT_ROOT/.venv/bin/python}
RAY=${RAY:-$FLASHDRAFT_ROOT/.venv/bin/ray}

# The allocation's hostnames, one per line (scontrol where Slurm is installed; a plain comma list otherwise).
hostnames() {
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$SLURM_JOB_NODELIST"
    else
        echo "$SLURM_JOB_NODELIST" | tr ',' '\n'
    fi
}

# on_node HOST CMD...: run CMD on HOST through srun (one task), or print it under DRY_RUN.
on_node() {
    local host=$1; shift
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "[$host] $*"
    else
        srun --nodes=1 --ntasks=1 -w "$host" "$@" &
    fi
}

# here CMD...: run CMD on this (the batch) node, or print it under DRY_RUN.
here() {
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "[$(hostnames | head -n1)] $*"
    else
        "$@"
    fi
}
