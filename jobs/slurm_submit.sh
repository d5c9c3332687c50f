#!/usr/bin/env bash
# `make features|train CLUSTER=slurm`: submit jobs/slurm_JOB.sbatch after checking that the partition can run it.
#   bash jobs/slurm_submit.sh capture|train [Hydra overrides...]
# Environment (the make variables): NODES (2); CPUS_PER_NODE and GPUS_PER_NODE (default: the most that NODES of the
# partition's nodes all have, from sinfo); PARTITION (Slurm's default partition); TIME; AFTER (a job id: start once
# it succeeded); SBATCH_ARGS (more sbatch options, e.g. --account=me). A request no NODES nodes of the partition can
# hold is refused here, naming the limit, as is whatever else `sbatch --test-only` refuses: a job Slurm accepts but
# can never start would pend for ever (PartitionConfig). The log goes to the checkout's logs/, wherever make runs.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

JOB=${1:?usage: slurm_submit.sh capture|train [overrides...]}
shift
SCRIPT=$FLASHDRAFT_ROOT/jobs/slurm_$JOB.sbatch
[[ -f $SCRIPT ]] || { echo "no job $JOB: no $SCRIPT" >&2; exit 2; }
NODES=${NODES:-2}

refuse() {
    echo "refused, nothing submitted: $*" >&2
    exit 1
}

for var in NODES CPUS_PER_NODE GPUS_PER_NODE; do
    [[ ${!var:-0} =~ ^[0-9]+$ ]] || refuse "$var=${!var}: not a whole number"
done
((NODES > 0)) || refuse "NODES=0"

PARTITION=${PARTITION:-$(sinfo -h -o '%P' | sed -n 's/\*$//p' | head -n1)}
[[ -n $PARTITION ]] || refuse "no PARTITION given and Slurm has no default partition (sinfo)"

# The partition's nodes, one "name cpus gpus" line each (gpus: the sum of its gpu GRES, e.g. gpu:a100:4(S:0-1)).
mapfile -t PARTITION_NODES < <(sinfo -h -N -p "$PARTITION" -o '%N %c %G' | sort -u | awk '{
    gpus = 0
    n = split($3, gres, ",")
    for (i = 1; i <= n; i++) {
        sub(/\(.*/, "", gres[i])
        if (gres[i] ~ /^gpu(:|$)/) { k = split(gres[i], f, ":"); gpus += (f[k] ~ /^[0-9]+$/ ? f[k] : 1) }
    }
    print $1, $2, gpus
}')
((${#PARTITION_NODES[@]} > 0)) || refuse "no partition $PARTITION (PARTITION) with nodes; sinfo lists:" \
    "$(sinfo -h -o '%P (%D nodes)' | paste -sd' ')"

# nth_most FIELD [GPUS]: the largest value of FIELD (2: CPUs, 3: GPUs) that NODES of the partition's nodes all have
# (of those with at least GPUS GPUs).
nth_most() {
    printf '%s\n' "${PARTITION_NODES[@]}" | awk -v f="$1" -v g="${2:-0}" '$3 >= g { print $f }' | sort -rn \
        | sed -n "${NODES}p"
}

# fitting CPUS GPUS: how many of the partition's nodes have at least CPUS CPUs and GPUS GPUs.
fitting() {
    printf '%s\n' "${PARTITION_NODES[@]}" | awk -v c="$1" -v g="$2" '$2 >= c && $3 >= g { n++ } END { print n + 0 }'
}

# node_kinds: the partition's nodes grouped by size, e.g. "2 nodes with 1 CPUs and 0 GPUs (n1 n2)".
node_kinds() {
    printf '%s\n' "${PARTITION_NODES[@]}" | awk '
        { key = $2 " CPUs and " $3 " GPUs"; n[key]++; names[key] = names[key] " " $1 }
        END { for (k in n) printf "%s%d nodes with %s (%s)", (sep++ ? "; " : ""), n[k], k, substr(names[k], 2) }'
}

((${#PARTITION_NODES[@]} >= NODES)) || refuse "partition $PARTITION has ${#PARTITION_NODES[@]} nodes, NODES=$NODES:" \
    "$(node_kinds)"
GPUS=${GPUS_PER_NODE:-$(nth_most 3)}
CPUS=${CPUS_PER_NODE:-$(nth_most 2 "$GPUS")}
CPUS=${CPUS:-1}  # no NODES nodes with GPUS GPUs: refused below
(($(fitting "$CPUS" "$GPUS") >= NODES)) || refuse "partition $PARTITION has no $NODES nodes with $CPUS CPUs" \
    "(CPUS_PER_NODE) and $GPUS GPUs (GPUS_PER_NODE) each; it has $(node_kinds)"

OPTS=(--nodes="$NODES" --cpus-per-task="$CPUS" --gpus-per-node="$GPUS" --partition="$PARTITION"
    --output="$FLASHDRAFT_ROOT/logs/%x-%j.out" ${TIME:+--time=$TIME} ${AFTER:+--dependency=afterok:$AFTER})
# shellcheck disable=SC2206  # SBATCH_ARGS is a word list
OPTS+=(${SBATCH_ARGS:-})
if dry; then  # the partition was read and the request checked against it: print the submission
    echo "GPUS_PER_NODE=$GPUS sbatch --parsable ${OPTS[*]} $SCRIPT $*"
    exit
fi
if ! test_only=$(sbatch --test-only "${OPTS[@]}" "$SCRIPT" 2>&1); then
    limits=$(sinfo -h -p "$PARTITION" -o 'time limit %l, jobs of %s nodes' | head -n1)
    refuse "sbatch --test-only ${OPTS[*]}: $test_only (partition $PARTITION: $limits; $(node_kinds))"
fi

mkdir -p "$FLASHDRAFT_ROOT/logs"
# the job reads GPUS_PER_NODE (jobs/common.sh gpus_per_node): the count asked for here
out=$(GPUS_PER_NODE=$GPUS sbatch --parsable "${OPTS[@]}" "$SCRIPT" "$@")
id=${out%%;*}
echo "submitted $JOB job $id ($NODES nodes with $CPUS CPUs and $GPUS GPUs each, partition $PARTITION):" \
    "log logs/flashdraft-$JOB-$id.out; chain with AFTER=$id"
