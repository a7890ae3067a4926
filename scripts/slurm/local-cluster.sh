#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (slurmctld + slurmd on loopback), for trying the
# recipes here and for scripts/slurm/test-local.sh. Needs root (it installs Debian's slurm-wlm
# and munge when missing). Idempotent: a running cluster is left as it is.
#
#   bash scripts/slurm/local-cluster.sh [start|stop]    # default: start
#   export SLURM_CONF=${DSPARK_SLURM_DIR:-/tmp/dspark-slurm}/slurm.conf
#
# The settings are the ones that work in a container without systemd (cgroup v1 hybrid hosts:
# cgroup/v2 dies with "Hybrid mode is not supported"; proctrack/linuxproc tracks by parentage).
set -euo pipefail
DIR=${DSPARK_SLURM_DIR:-/tmp/dspark-slurm}
export SLURM_CONF=$DIR/slurm.conf
NODE=$(hostname -s)

stop() {
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
}

if [ "${1:-start}" = stop ]; then stop; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "error: slurm-wlm and munge are missing; install them: sudo apt-get install slurm-wlm munge" >&2; exit 2; }
  echo "installing slurm-wlm and munge" >&2
  export DEBIAN_FRONTEND=noninteractive
  # Waiting for the dpkg lock: CI installs Docker beside this check (scripts/docker-e2e.sh --build).
  apt_get() { apt-get -o DPkg::Lock::Timeout=600 "$@"; }
  apt_get install -y -q slurm-wlm munge >/dev/null 2>&1 \
    || { apt_get update -q >/dev/null && apt_get install -y -q slurm-wlm munge >/dev/null; }
fi

if ! pgrep -x munged >/dev/null; then
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  [ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  if id munge >/dev/null 2>&1; then runuser -u munge -- munged --force; else munged --force; fi
fi

mkdir -p "$DIR"/{state,spool,log}
cat >"$DIR/slurm.conf" <<EOF
ClusterName=dspark-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
KillWait=30
MpiDefault=none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$(($(free -m | awk '/^Mem:/{print $2}') * 9 / 10)) State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
cat >"$DIR/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
IgnoreSystemd=yes
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
EOF

pgrep -x slurmctld >/dev/null || slurmctld -f "$SLURM_CONF"
pgrep -x slurmd >/dev/null || slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
  state=$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
  case $state in idle|mix|alloc) echo "slurm: $NODE $state (SLURM_CONF=$SLURM_CONF)" >&2; exit 0 ;; esac
  sleep 1
done
echo "error: the local Slurm node did not come up (state: ${state:-none}); read $DIR/log/*.log" >&2
exit 1
