#!/usr/bin/env bash
# start-cluster.sh - a real one-node Slurm cluster on 127.0.0.1 for gptflow's tests (Debian,
# root, no systemd): munged, MariaDB + slurmdbd (sacct is what the Snakemake Slurm plugin polls
# with), slurmctld and slurmd, from Debian's packages, and Slurm's Torque wrappers (qsub, qstat,
# qdel: slurm-wlm-torque, for profiles/pbs). Idempotent: installs what is missing, rewrites
# configs, restarts only daemons that are down or whose config changed.
#
#   bash tests/slurm/start-cluster.sh            # install, configure, start (~25 s fresh, ~1 s when up)
#   bash tests/slurm/start-cluster.sh --status   # what runs
#   bash tests/slurm/start-cluster.sh --stop     # stop the daemons it started (by pid file)
#
# Standard paths on purpose (/etc/slurm/slurm.conf): the plugin's jobstep executor drops
# SLURM_CONF from the environment of the srun inside a job. Prints one line when the node
# is idle: "slurm cluster up: node NODE, partition debug, account default".
set -euo pipefail

CLUSTER=gptflow
PARTITION=debug
ACCOUNT=default
ETC=/etc/slurm
LOG=/var/log/slurm
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
DBD_PID=/run/slurmdbd.pid
MUNGE_SOCK=/run/munge/munge.socket.2
MUNGE_PID=/run/munge/munged.pid
DB_SOCK=/run/mysqld/mysqld.sock
DB_PID=/run/mysqld/mysqld.pid
DB_PASS=gptflow-local-only   # MariaDB listens on 127.0.0.1 only
export SLURM_CONF=$ETC/slurm.conf

say() { printf 'start-cluster: %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }
running() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
munge_works() { munge --socket="$MUNGE_SOCK" -n 2>/dev/null | unmunge --socket="$MUNGE_SOCK" >/dev/null 2>&1; }
db_works() { mariadb-admin --socket="$DB_SOCK" ping >/dev/null 2>&1; }
wait_until() {  # wait_until SECONDS COMMAND...
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do ((SECONDS < deadline)) || return 1; sleep 0.2; done
}
stop() {  # stop PIDFILE: the process in the pid file, never by name
  local pid
  if running "$1"; then
    pid=$(cat "$1"); kill "$pid" 2>/dev/null || true
    wait_until 15 bash -c "! kill -0 $pid 2>/dev/null" || kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

# One start or stop at a time on this machine: the workers of a parallel test session
# (pytest-xdist), or two sessions, would both find a daemon down and both start it. A later
# start waits for the lock, then finds everything up (~1 s). The script runs again under
# flock; -o: the daemons it starts do not inherit the lock (they would hold it while they run).
LOCK=/run/gptflow-start-cluster.lock
lock() {
  [[ ${GPTFLOW_CLUSTER_LOCK:-} == "$LOCK" ]] ||
    GPTFLOW_CLUSTER_LOCK=$LOCK exec flock -o "$LOCK" bash "$0" "$@"
}

case "${1:-}" in
  --stop) lock "$@"
    for p in "$SLURMD_PID" "$CTLD_PID" "$DBD_PID" "$DB_PID" "$MUNGE_PID"; do stop "$p"; done; exit 0 ;;
  --status)
    for p in "$MUNGE_PID" "$DB_PID" "$DBD_PID" "$CTLD_PID" "$SLURMD_PID"; do
      if running "$p"; then echo "$p: pid $(cat "$p")"; else echo "$p: not running"; fi
    done
    exit 0 ;;
  "") ;;
  *) die "unknown argument '$1' (use --status or --stop)" ;;
esac
[[ $(id -u) == 0 ]] || die "must run as root (it installs Debian packages and starts daemons)"
command -v apt-get >/dev/null || die "needs Debian/Ubuntu (apt-get)"
lock "$@"

# 1. packages; no init system here, so maintainer scripts must not try to start services
# slurm-wlm-torque: Slurm's own Torque-syntax qsub/qstat/qdel, for profiles/pbs (test_pbs)
PKGS=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server slurm-wlm-torque)
MISSING=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || MISSING+=("$p")
done
if ((${#MISSING[@]})); then
  say "installing ${MISSING[*]}"
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  for attempt in 1 2 3; do
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${MISSING[@]}" >/dev/null && break
    ((attempt < 3)) || die "apt-get install ${MISSING[*]} failed"
    sleep 5
  done
fi

# 2. the node's name must resolve without DNS
NODE=$(hostname -s)
getent hosts "$NODE" >/dev/null || echo "127.0.0.1 $NODE" >> /etc/hosts

# 3. munge: the key belongs to the user munged runs as, readable by nobody else
install -d -m 0755 "$ETC" "$LOG" /var/spool/slurmctld /var/spool/slurmd
install -d -o munge -g munge -m 0755 /run/munge
[[ -s /etc/munge/munge.key ]] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
if ! munge_works; then
  stop "$MUNGE_PID"
  runuser -u munge -- /usr/sbin/munged --force </dev/null >/dev/null 2>&1
  wait_until 10 munge_works || die "munged does not answer"
fi

# 4. slurm.conf: no cgroup plugin (no systemd, no delegation); a default memory per CPU so
# jobs without --mem do not take the whole node; frequent scheduling; a short requeue hold: a
# requeued job waits cred_expire before it can run again (measured: 35-40 s at 30, 17 s at 10)
# 8 CPUs whatever the machine has (config_overrides): on a 2-core test machine two jobs of
# 2 tasks must be able to run at once, e.g. a rerun training job beside its predecessor.
# 4 GPUs as a generic resource backed by character devices that are /dev/null (major 1,
# minor 3) under /var/lib/gptflow-test-gpus: jobs ask for --gres=gpu:N as on a GPU cluster
# and Slurm schedules them (and sets CUDA_VISIBLE_DEVICES), while the ranks find no CUDA
# device and train on the CPU
CPUS=8
GPUS=4
FAKE_GPUS=/var/lib/gptflow-test-gpus
mkdir -p "$FAKE_GPUS"
for ((i = 0; i < GPUS; i++)); do
  [[ -c "$FAKE_GPUS/gpu$i" ]] || mknod "$FAKE_GPUS/gpu$i" c 1 3
done
HW="CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1"
MEM=$(($(slurmd -C | head -1 | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') * 95 / 100))
CONF="# written by gptflow tests/slurm/start-cluster.sh
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_interval=10
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=300
KillWait=5
InactiveLimit=0
Waittime=0
MailProg=/bin/true
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE $HW RealMemory=$MEM Gres=gpu:$GPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
GRES="NodeName=$NODE Name=gpu File=$FAKE_GPUS/gpu[0-$((GPUS - 1))]"
RESTART_SLURM=0
if [[ "$(cat "$ETC/slurm.conf" 2>/dev/null)" != "$CONF" ]]; then
  printf '%s\n' "$CONF" > "$ETC/slurm.conf" && chmod 644 "$ETC/slurm.conf"
  RESTART_SLURM=1
fi
if [[ "$(cat "$ETC/gres.conf" 2>/dev/null)" != "$GRES" ]]; then
  printf '%s\n' "$GRES" > "$ETC/gres.conf" && chmod 644 "$ETC/gres.conf"
  RESTART_SLURM=1
fi
if [[ -f /var/spool/slurmctld/clustername && "$(cat /var/spool/slurmctld/clustername)" != "$CLUSTER" ]]; then
  stop "$SLURMD_PID"; stop "$CTLD_PID"; rm -rf /var/spool/slurmctld/*   # another cluster's state
fi

# 5. accounting: MariaDB on 127.0.0.1, slurmdbd, cluster + account + user root
install -d -o mysql -g mysql -m 0755 /run/mysqld
if ! db_works; then
  stop "$DB_PID"
  if [[ ! -d /var/lib/mysql/mysql ]]; then
    install -d -o mysql -g mysql -m 0700 /var/lib/mysql
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql --auth-root-authentication-method=socket >/dev/null
  fi
  setsid -f /usr/sbin/mariadbd --no-defaults --user=mysql --datadir=/var/lib/mysql \
    --pid-file="$DB_PID" --socket="$DB_SOCK" --bind-address=127.0.0.1 --port=3306 \
    --innodb-buffer-pool-size=128M --log-error="$LOG/mariadbd.log" </dev/null >/dev/null 2>&1
  wait_until 30 db_works || die "mariadbd did not start (see $LOG/mariadbd.log)"
fi
mariadb --socket="$DB_SOCK" -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
  CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
DBD="AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$DBD_PID
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db"
if [[ "$(cat "$ETC/slurmdbd.conf" 2>/dev/null)" != "$DBD" ]]; then
  printf '%s\n' "$DBD" > "$ETC/slurmdbd.conf"
  stop "$DBD_PID"
fi
chmod 600 "$ETC/slurmdbd.conf"   # slurmdbd refuses a config others can read
running "$DBD_PID" || slurmdbd </dev/null >/dev/null 2>&1
wait_until 30 sacctmgr -n list cluster >/dev/null 2>&1 ||
  die "slurmdbd does not answer (see $LOG/slurmdbd.log)"
# sacctmgr exits 1 when the entity exists: add only what is missing
sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" ||
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
sacctmgr -n -P list assoc cluster="$CLUSTER" format=account | grep -qx "$ACCOUNT" ||
  sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" Description=tests Organization=gptflow >/dev/null
sacctmgr -n -P list assoc cluster="$CLUSTER" user=root format=account | grep -qx "$ACCOUNT" ||
  sacctmgr -i add user root Account="$ACCOUNT" DefaultAccount="$ACCOUNT" Cluster="$CLUSTER" >/dev/null

# 6. slurmctld, slurmd; then wait for the node
if ((RESTART_SLURM)); then stop "$SLURMD_PID"; stop "$CTLD_PID"; fi
ctld_up() { scontrol ping 2>/dev/null | grep -q "is UP"; }
if ! running "$CTLD_PID"; then
  slurmctld </dev/null >/dev/null 2>&1
  wait_until 30 ctld_up || die "slurmctld did not come up (see $LOG/slurmctld.log)"
fi
running "$SLURMD_PID" || slurmd </dev/null >/dev/null 2>&1
node_ready() {
  local state
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -1)
  case "$state" in
    idle | mixed | allocated | completing) return 0 ;;
    *drain* | down*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
  esac
  return 1
}
wait_until 60 node_ready || { sinfo -R >&2 || true; die "node $NODE did not become idle (see $LOG/slurmd.log)"; }
echo "slurm cluster up: node $NODE, partition $PARTITION, account $ACCOUNT"
