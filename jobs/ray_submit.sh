#!/usr/bin/env bash
# Feature capture on an existing Ray cluster, submitted as a Ray job from any machine that reaches it:
#   RAY_ADDRESS=http://head:8265 NUM_ACTORS=16 bash jobs/ray_submit.sh model=qwen3-8b data=nemotron
# The working tree is uploaded; the cluster's nodes need the same environment (scripts/setup.sh).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard, e.g. http://head:8265}"
here "$RAY" job submit --address="$RAY_ADDRESS" --working-dir="$FLASHDRAFT_ROOT" \
    --runtime-env-json='{"excludes": [".venv", "runs", ".git"]}' -- \
    python -m pipeline cluster=ray cluster.ray_address=auto cluster.num_actors="${NUM_ACTORS:-8}" "$@"
