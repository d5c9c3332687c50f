#!/usr/bin/env bash
# Feature capture on an existing Ray cluster, submitted as a Ray job from any machine that reaches it:
#   RAY_ADDRESS=http://head:8265 NUM_ACTORS=16 bash jobs/ray_submit.sh run_dir=/shared/runs/qwen3-8b model=qwen3-8b
# The working tree is uploaded and the job runs in that copy, on the head node: the run's outputs (run_dir, and
# features_dir, by default run_dir/features) must be absolute paths on a filesystem every node sees; a relative one
# is refused here, before anything is submitted, as is a fleet the cluster's nodes cannot hold (jobs/ray_fits.py:
# NUM_ACTORS actors of cluster.cpus_per_actor CPUs and cluster.gpus_per_actor GPUs; CHECK_FIT=0 skips it, for a
# cluster that scales up). The nodes need the same environment (scripts/setup.sh): the job runs CLUSTER_PYTHON, by
# default the `python` on the PATH the head node was started with (start the nodes from the activated environment:
# `source .venv/bin/activate && ray start ...`), else give its path. The script follows the job's log until it
# ends; stopped (Ctrl-C, or make killed) it stops the job too and exits within STOP_WAIT seconds (default 20) plus
# a few, whatever the job is waiting for (see stop_job).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard, e.g. http://head:8265}"
overrides=(cluster=ray cluster.ray_address=auto cluster.num_actors="${NUM_ACTORS:-8}" "$@")
"$PY" -m pipeline paths "${overrides[@]}" >&2
[[ ${CHECK_FIT:-1} == 0 ]] || dry || "$PY" "$FLASHDRAFT_ROOT/jobs/ray_fits.py" "$RAY_ADDRESS" "${overrides[@]}"

ID=flashdraft-capture-$(date -u +%Y%m%d-%H%M%S)-$$
submit=("$RAY" job submit --address="$RAY_ADDRESS" --submission-id="$ID" --working-dir="$FLASHDRAFT_ROOT"
    --runtime-env-json='{"excludes": [".venv", "runs", ".git"]}' -- "${CLUSTER_PYTHON:-python}" -m pipeline
    "${overrides[@]}")
if dry; then
    here "${submit[@]}"
    exit
fi

STOP_WAIT=${STOP_WAIT:-20}

# stop_job SIGNAL CODE: the job ends with this script: stop it on the cluster, then the log follower; exit CODE.
# `ray job stop` waits, without a limit of its own, until the job has ended: a RUNNING job ends within seconds (Ray
# sends its driver SIGTERM, then SIGKILL 3 s later), but a job PENDING (its runtime environment being set up, or its
# driver waiting for room on the head node) cannot end before its driver starts. Ray keeps the stop and ends the job
# as its driver starts; the wait is cut at STOP_WAIT seconds and said, so that Ctrl-C never waits on the cluster.
stop_job() {
    trap - INT TERM HUP
    echo "$1: stopping Ray job $ID" >&2
    local rc=0
    timeout -k 2 "$STOP_WAIT" "$RAY" job stop --address="$RAY_ADDRESS" "$ID" >&2 || rc=$?
    if ((rc == 124 || rc == 137)); then
        echo "Ray job $ID has not ended ${STOP_WAIT} s after the stop (a PENDING job ends as its driver starts):" \
            "Ray keeps the stop; \`$RAY job status $ID --address=$RAY_ADDRESS\` says when it has ended" >&2
    elif ((rc != 0)); then
        echo "ray job stop $ID failed (exit $rc): the job may still run; run it again" >&2
    fi
    if [[ -n ${client:-} ]]; then  # the log follower: asked to end, killed if it has not within 5 s
        kill "$client" 2>/dev/null || true
        for _ in {1..50}; do kill -0 "$client" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$client" 2>/dev/null || true
        wait "$client" 2>/dev/null || true
    fi
    exit "$2"
}
trap 'stop_job SIGINT 130' INT
trap 'stop_job SIGTERM 143' TERM
trap 'stop_job SIGHUP 129' HUP
# in the background, so that a signal runs the trap at once (a foreground command would hold it until it ends)
"${submit[@]}" &
client=$!
wait "$client"
