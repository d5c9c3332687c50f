#!/usr/bin/env bash
# Feature capture on an existing Ray cluster, submitted as a Ray job from any machine that reaches it:
#   RAY_ADDRESS=http://head:8265 NUM_ACTORS=16 bash jobs/ray_submit.sh run_dir=/shared/runs/qwen3-8b model=qwen3-8b
# The working tree is uploaded and the job runs in that copy, on the head node: the run's outputs (run_dir, and
# features_dir, by default run_dir/features) must be absolute paths on a filesystem every node sees; a relative one
# is refused here, before anything is submitted. The nodes need the same environment (scripts/setup.sh): the job
# runs CLUSTER_PYTHON, by default the `python` on the PATH the head node was started with (start the nodes from
# the activated environment: `source .venv/bin/activate && ray start ...`), else give its path.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard, e.g. http://head:8265}"
overrides=(cluster=ray cluster.ray_address=auto cluster.num_actors="${NUM_ACTORS:-8}" "$@")
"$PY" -m pipeline paths "${overrides[@]}" >&2
here "$RAY" job submit --address="$RAY_ADDRESS" --working-dir="$FLASHDRAFT_ROOT" \
    --runtime-env-json='{"excludes": [".venv", "runs", ".git"]}' -- \
    "${CLUSTER_PYTHON:-python}" -m pipeline "${overrides[@]}"
