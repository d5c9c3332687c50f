#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine (nodes n1 and n2, both 127.0.0.1), for the cluster tests
# and for trying jobs/*.sbatch without a cluster. Needs root; installs slurm-wlm and munge with apt-get if missing.
#   eval "$(scripts/slurm-local.sh up)"     # start (idempotent); prints the SLURM_CONF export line
#   scripts/slurm-local.sh status | down     # down cancels every job, stops the daemons, removes the state dir
# State, config and daemon logs: $SLURM_LOCAL_DIR (default /tmp/flashdraft-slurm).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/flashdraft-slurm}
export SLURM_CONF=$DIR/slurm.conf
NODES=(n1 n2)

say() { echo "slurm-local: $*" >&2; }
die() { say "$*"; exit 1; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
    [[ $(id -u) == 0 ]] || die "slurm-wlm and munge are not installed and installing them needs root"
    command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get"
    say "installing slurm-wlm and munge (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; }
}

start_munge() {
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
    chmod 700 /etc/munge /var/log/munge && chmod 600 /etc/munge/munge.key && chmod 755 /run/munge
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return  # a munged already answers
    runuser -u munge -- munged --force
    munge -n | unmunge >/dev/null || die "munged does not answer (/var/log/munge/munged.log)"
    touch "$DIR/munged.ours"
}

write_conf() {
    cat >"$SLURM_CONF" <<EOF
ClusterName=flashdraft
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdSpoolDir=$DIR/%n
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
KillWait=5
NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001-17002 CPUs=1 State=UNKNOWN
PartitionName=local Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
}

nodes_idle() { [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | grep -c -E ' (idle|mix|alloc)$') == 2 ]]; }

up() {
    [[ $(id -u) == 0 ]] || die "needs root (munged runs as user munge, slurmd as root)"
    install_packages
    if [[ -f $SLURM_CONF ]] && nodes_idle; then
        say "already up"
    else
        down 2>/dev/null
        mkdir -p "$DIR/ctld" "${NODES[@]/#/$DIR/}"
        start_munge
        write_conf
        slurmctld -c || die "slurmctld did not start ($DIR/slurmctld.log)"
        for node in "${NODES[@]}"; do
            slurmd -N "$node" || die "slurmd $node did not start ($DIR/slurmd-$node.log)"
        done
        for _ in $(seq 60); do nodes_idle && break; sleep 1; done
        nodes_idle || die "nodes not idle after 60 s: $(sinfo -N 2>&1) (logs in $DIR)"
        say "up: $(sinfo -h -N -o '%N:%t' | sort -u | tr '\n' ' ')"
    fi
    echo "export SLURM_CONF=$SLURM_CONF"
}

stop_pidfile() {  # stop_pidfile FILE: TERM the daemon whose pid FILE holds, wait up to 10 s, then KILL
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 0
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
}

down() {
    if [[ -f $SLURM_CONF ]] && squeue -h >/dev/null 2>&1; then
        squeue -h -o %i | xargs -r scancel --quiet 2>/dev/null || true
        for _ in $(seq 30); do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 1; done
    fi
    for node in "${NODES[@]}"; do stop_pidfile "$DIR/slurmd-$node.pid"; done
    stop_pidfile "$DIR/slurmctld.pid"
    [[ -f $DIR/munged.ours ]] && stop_pidfile /run/munge/munged.pid
    rm -rf "$DIR"
    say "down"
}

status() {
    [[ -f $SLURM_CONF ]] || die "not up (no $SLURM_CONF)"
    sinfo -N && squeue
    echo "export SLURM_CONF=$SLURM_CONF"
}

case ${1:-} in
    up | down | status) "$1" ;;
    *) die "usage: $0 up|down|status (state in \$SLURM_LOCAL_DIR, default /tmp/flashdraft-slurm)" ;;
esac
