#!/usr/bin/env bash
# Brings up what the real-launcher tests (tests/real_launchers.rs) run under: Open MPI's mpirun,
# MPICH's Hydra mpiexec, and a one-node Slurm cluster on this machine (munged, slurmctld, slurmd).
#
# Idempotent: installs only what is missing, leaves running daemons alone, and rewrites only a
# slurm.conf it wrote itself (an existing cluster's configuration is used as it is). Needs root
# and apt-get; without them it exits with 77 and says why, and the tests skip loudly.
#
#   bash scripts/slurm-local.sh          # prints the seconds the bring-up took
set -euo pipefail

SKIP=77
say() { echo "slurm-local: $*" >&2; }

if [ "$(uname -s)" != Linux ]; then
    say "not Linux; nothing to bring up"
    exit $SKIP
fi
if [ "$(id -u)" != 0 ]; then
    say "not root: cannot install or start Slurm (slurmd runs as root)"
    exit $SKIP
fi
start=$(date +%s.%N)

# 1. Packages.
missing=()
command -v munged >/dev/null || missing+=(munge)
{ command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null; } ||
    missing+=(slurm-wlm)
command -v mpirun.openmpi >/dev/null || missing+=(openmpi-bin)
command -v mpiexec.mpich >/dev/null || missing+=(mpich)
if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null; then
        say "apt-get not found; cannot install ${missing[*]}"
        exit $SKIP
    fi
    say "installing ${missing[*]}"
    apt-get update -o DPkg::Lock::Timeout=900 >/dev/null || true
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -o DPkg::Lock::Timeout=900 "${missing[@]}" >/dev/null; then
        say "apt-get install ${missing[*]} failed"
        exit $SKIP
    fi
fi

# 2. munged, which slurmctld and slurmd use to authenticate each other and srun.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile /etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    for d in /run/munge /var/lib/munge /var/log/munge; do
        mkdir -p "$d"
        chown munge:munge "$d"
    done
    chmod 0755 /run/munge
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n | unmunge >/dev/null
fi

# 3. slurm.conf: this host as controller and only node, with its real name and CPU count. No
# cgroups (proctrack/linuxproc, task/none): containers seldom delegate them.
host=$(hostname -s)
cpus=$(nproc --all)
conf=/etc/slurm/slurm.conf
marker="# Written by ferrocomm's scripts/slurm-local.sh"
if [ ! -e "$conf" ] || head -1 "$conf" | grep -qF "$marker"; then
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    new=$(
        cat <<EOF
$marker: a one-node cluster for the launcher tests.
ClusterName=ferrocomm
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
InactiveLimit=0
KillWait=5
MinJobAge=10
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    )
    if [ "$(cat "$conf" 2>/dev/null)" != "$new" ]; then
        echo "$new" >"$conf"
        # A running daemon would keep the old configuration.
        for p in /run/slurmctld.pid /run/slurmd.pid; do
            if [ -s "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null; then
                say "configuration changed: restarting $(basename "$p" .pid)"
                kill "$(cat "$p")"
                for _ in $(seq 100); do kill -0 "$(cat "$p")" 2>/dev/null || break; sleep 0.1; done
            fi
        done
    fi
else
    say "using the existing $conf (not written by this script)"
fi

# 4. The daemons, each unless its pid file names a live one.
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if ! running /run/slurmctld.pid; then
    say "starting slurmctld"
    slurmctld
fi
if ! running /run/slurmd.pid; then
    say "starting slurmd"
    slurmd
fi

# 5. Until the node takes jobs. A node left down or drained by an earlier run is resumed.
state=""
for i in $(seq 600); do
    state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null | head -1 || true)
    case "$state" in
        idle | mix | alloc | comp) break ;;
        down* | drain* | drng*) [ $((i % 20)) = 1 ] && scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.1
done
case "$state" in
    idle | mix | alloc | comp) ;;
    *)
        say "node $host is not usable (sinfo state: '${state:-none}'); logs in /var/log/slurm/"
        tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
        exit 1
        ;;
esac
end=$(date +%s.%N)
say "$(awk -v s="$start" -v e="$end" -v h="$host" -v t="$state" -v c="$cpus" \
    'BEGIN { printf "node %s is %s (%s CPUs); bring-up took %.1f s", h, t, c, e - s }')"
