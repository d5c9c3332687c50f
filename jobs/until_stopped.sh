#!/usr/bin/env bash
# until_stopped.sh CMD...: run CMD (a `ray start --block` in a Slurm step) until it exits or the job stops the step
# with SIGTERM (jobs/common.sh stop_steps). `ray start --block` exits 1 on SIGTERM, which srun reports as a failed
# task ("srun: error: n1: task 0: Exited with exit code 1") in the log of a job that completed: a stop asked for
# exits 0 here, once CMD has shut down; any other exit is CMD's own.
stopped=0
trap 'stopped=1; kill -TERM "$pid" 2>/dev/null' TERM
"$@" &
pid=$!
wait "$pid"
rc=$?
while kill -0 "$pid" 2>/dev/null; do  # interrupted by the TERM: let CMD finish shutting down
    wait "$pid"
    rc=$?
done
((stopped)) && exit 0
exit "$rc"
