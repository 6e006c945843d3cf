#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try launch/slurm_gpu.sbatch under the real
# scheduler (tests/launch/test_slurm.py does, in the process tier).
#
#   launch/testing/local_slurm.sh start DIR   # prints: export SLURM_CONF=DIR/slurm.conf
#   eval "$(launch/testing/local_slurm.sh start /tmp/slurm)"
#   sbatch ...; squeue; scontrol show job ID
#   launch/testing/local_slurm.sh stop DIR    # cancels its jobs, stops what start started
#   launch/testing/local_slurm.sh install     # only the packages (CI, before the tests)
#
# Needs root: slurmd starts every job's tasks as the submitting user, and the packages come
# from apt. `start` installs Debian's slurmctld, slurmd, slurm-client and munge (22.05 on
# Debian 12) when they are missing, without letting apt start their system services; then
# writes a slurm.conf for one node, this host (`hostname -s`) with the CPUs and memory
# `slurmd -C` finds, and starts munged (as the munge user, with a key of its own), slurmctld
# and slurmd in the foreground of background processes whose PIDs it keeps in DIR/pids.
# Everything else lives in DIR too: config, key, sockets, state, spool, logs. Nothing in
# /etc is written, so a cluster already on the machine is not disturbed, and two of these
# can run at once (each on free ports: one per pytest-xdist worker).
#
# Chosen settings, and why:
#   ProctrackType=proctrack/pgid  no cgroups or systemd needed (proctrack/linuxproc lets a
#                                 job's background children outlive it)
#   TaskPlugin=task/none          no CPU binding: the node is the whole machine
#   EnforcePartLimits=ALL         a request this node cannot hold fails at sbatch instead of
#                                 pending forever
#   no accounting                 no slurmdbd: `scontrol show job` instead of sacct
#   cred_expire=10                a requeued job starts again after 11 s, not 121: SLURM holds
#                                 it back for that long so that the node no longer refuses
#                                 the new run's credential as one it revoked (forcing an
#                                 earlier start with `scontrol update StartTime=now` can fail
#                                 the job that way)
#   sched_interval=1, bf_interval=1  pending jobs are looked at every second, not every 30
#                                 to 60: a requeued job starts as soon as it may
#
# Environment:
#   SLURMCTLD_PORT, SLURMD_PORT  the daemons' ports (default: free ones)
#   LOCAL_SLURM_WAIT_S           seconds `start` waits for the node to be idle and `stop`
#                                for the jobs to end (default 60)
#
# Exit status: 0, or 3 when this machine cannot run it (not root, or the packages are
# missing and apt-get is not there): the tests skip then, naming the reason; anything else
# that fails is 1 and names what.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
wait_s=${LOCAL_SLURM_WAIT_S:-60}

die() {
  printf 'local_slurm.sh: error: %s\n' "$*" >&2
  exit 1
}
cannot() {
  printf 'local_slurm.sh: cannot run here: %s\n' "$*" >&2
  exit 3
}
usage() {
  echo "usage: $0 start DIR | stop DIR | install" >&2
  exit 2
}

action=${1:-}
case $action in
  start | stop) (($# == 2)) || usage ;;
  install) (($# == 1)) || usage ;;
  *) usage ;;
esac
dir=${2:-}
[[ -z $dir || $dir == /* ]] || dir=$PWD/$dir
[[ $wait_s =~ ^[1-9][0-9]*$ ]] || die "LOCAL_SLURM_WAIT_S must be a positive number of seconds, not '$wait_s'"
for port in ${SLURMCTLD_PORT:-} ${SLURMD_PORT:-}; do
  [[ $port =~ ^[1-9][0-9]*$ ]] && ((port < 65536)) || die "SLURMCTLD_PORT and SLURMD_PORT must be port numbers, not '$port'"
done

# Installs what is missing. policy-rc.d (exit 101) is Debian's way to keep a package's
# postinst from starting its service: a systemd machine would otherwise start slurmctld,
# slurmd and munged system-wide, on the ports and socket of a real installation. Two of these
# installing at once (pytest-xdist workers) wait for each other on apt's lock.
install() {
  ((EUID == 0)) || cannot "it must run as root (slurmd starts jobs as their users, apt installs the packages); this is uid $EUID"
  local missing=0 tool
  for tool in slurmctld slurmd sbatch scontrol munged mungekey; do
    command -v "$tool" >/dev/null || missing=1
  done
  ((missing)) || return 0
  command -v apt-get >/dev/null ||
    cannot "the SLURM and munge packages are missing and there is no apt-get to install them (${PACKAGES[*]})"
  local policy=/usr/sbin/policy-rc.d made_policy=0 log status=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    made_policy=1
  fi
  log=$(mktemp "${TMPDIR:-/tmp}/local_slurm-apt.XXXXXX")
  echo "local_slurm.sh: apt-get install ${PACKAGES[*]} (log: $log)" >&2
  local apt=(apt-get -o DPkg::Lock::Timeout=600 -y --no-install-recommends)
  {
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install "${PACKAGES[@]}" ||
      { "${apt[@]}" update && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install "${PACKAGES[@]}"; }
  } >"$log" 2>&1 || status=$?
  if ((made_policy)); then rm -f "$policy"; fi
  ((status == 0)) || { tail -n 20 "$log" >&2; die "apt-get install ${PACKAGES[*]} failed (log: $log)"; }
  rm -f "$log"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# Starts the daemon NAME (the program that ends up running: setsid and setpriv exec it) in
# the background, in a session of its own (a Ctrl-C meant for the caller does not reach it),
# and records "NAME PID" in DIR/pids once the PID runs NAME.
spawn() {
  local name=$1 pid tries
  shift
  setsid "$@" </dev/null >>"$dir/$name.out" 2>&1 &
  pid=$!
  for ((tries = 0; tries < 50; tries++)); do
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) != "$name" ]] || break
    sleep 0.1
  done
  echo "$name $pid" >>"$dir/pids"
}

node_state() {
  sinfo --noheader --nodes="$host" --format=%T 2>/dev/null || true
}

start() {
  install
  mkdir -p "$dir"
  [[ ! -e $dir/pids ]] || die "$dir/pids exists: a cluster may be running from $dir; run '$0 stop $dir' first"

  host=$(hostname -s)
  local node
  node=$(slurmd -C | grep '^NodeName=') || die "slurmd -C did not describe this node"
  local ctld_port=${SLURMCTLD_PORT:-$(free_port)} slurmd_port=${SLURMD_PORT:-$(free_port)}
  # munged wants its socket's directory its own, enterable by all (clients) and writable by
  # no one else; the key stays private to it (mungekey writes it 0600).
  chmod 755 "$dir"
  mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
  chown munge: "$dir/munge"
  chmod 755 "$dir/munge"
  setpriv --reuid=munge --regid=munge --init-groups test -x "$dir" ||
    die "the munge user cannot enter $dir: give it a directory whose parents others may enter (chmod o+x)"
  [[ -f $dir/munge/munge.key ]] ||
    setpriv --reuid=munge --regid=munge --init-groups mungekey --create --keyfile="$dir/munge/munge.key"

  # A job id range of its own (from this process's id), so that two of these clusters do
  # not hand out the same ids, on which the launcher's default coordinator port depends.
  cat >"$dir/slurm.conf" <<CONF
# Written by launch/testing/local_slurm.sh: one node, this host.
ClusterName=jaxrl-local
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
MailProg=/bin/true
MpiDefault=none
FirstJobId=$((($$ % 900 + 100) * 1000))
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$node State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF=$dir/slurm.conf
  : >"$dir/pids"

  spawn munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground \
    --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --log-file="$dir/munge/munged.log" --pid-file="$dir/munge/munged.pid" \
    --seed-file="$dir/munge/munged.seed"
  local deadline=$((SECONDS + wait_s))
  until munge --socket="$dir/munge/munge.socket" --no-input >/dev/null 2>&1; do
    daemon_alive munged || fail_start "munged exited"
    ((SECONDS < deadline)) || fail_start "munged did not answer on $dir/munge/munge.socket"
    sleep 0.1
  done
  spawn slurmctld slurmctld -D -i -f "$SLURM_CONF"
  spawn slurmd slurmd -D -f "$SLURM_CONF"
  until [[ $(node_state) == idle ]]; do
    daemon_alive slurmctld || fail_start "slurmctld exited"
    daemon_alive slurmd || fail_start "slurmd exited"
    ((SECONDS < deadline)) || fail_start "node $host is '$(node_state)', not idle, after ${wait_s}s"
    sleep 0.2
  done
  echo "local_slurm.sh: node $host idle ($(grep -o 'CPUs=[0-9]*' <<<"$node")), ports $ctld_port and $slurmd_port, logs in $dir" >&2
  echo "export SLURM_CONF=$SLURM_CONF"
}

fail_start() {
  local log
  for log in "$dir"/slurmctld.log "$dir"/slurmd.log "$dir"/munge/munged.log "$dir"/*.out; do
    [[ -s $log ]] || continue
    echo "--- last lines of $log" >&2
    tail -n 15 "$log" >&2
  done
  stop_daemons
  die "$*"
}

# Stops the daemons DIR/pids names, newest first, each only while its PID still runs the
# program it was started as (a PID the system gave to another process since is left alone).
stop_daemons() {
  [[ -f $dir/pids ]] || return 0
  local name pid lines=() i waited
  mapfile -t lines <"$dir/pids"
  for ((i = ${#lines[@]} - 1; i >= 0; i--)); do
    read -r name pid <<<"${lines[i]}"
    is_running "$name" "$pid" || continue
    kill -TERM "$pid" 2>/dev/null || true
    for ((waited = 0; waited < 100; waited++)); do
      is_running "$name" "$pid" || break
      sleep 0.1
    done
    if is_running "$name" "$pid"; then
      echo "local_slurm.sh: $name ($pid) did not stop on SIGTERM within 10s: SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$dir/pids"
}

# Whether the daemon NAME that DIR/pids lists still runs.
daemon_alive() {
  local name pid
  read -r name pid < <(grep "^$1 " "$dir/pids")
  is_running "$name" "$pid"
}

is_running() {
  [[ $(cat "/proc/$2/comm" 2>/dev/null) == "$1" ]]
}

stop() {
  [[ -f $dir/pids ]] || { echo "local_slurm.sh: nothing to stop in $dir (no $dir/pids)" >&2; return 0; }
  export SLURM_CONF=$dir/slurm.conf
  # Jobs first, while slurmd can still end their tasks: a slurmstepd outlives its slurmd.
  local jobs
  jobs=$(squeue --noheader --format=%i 2>/dev/null || true)
  if [[ -n $jobs ]]; then
    # shellcheck disable=SC2086  # one id a word
    scancel $jobs 2>/dev/null || true
    local deadline=$((SECONDS + wait_s))
    while [[ -n $(squeue --noheader --format=%i 2>/dev/null || true) ]]; do
      if ((SECONDS >= deadline)); then
        echo "local_slurm.sh: jobs still listed after ${wait_s}s: $(squeue --noheader 2>&1 | tr '\n' ';')" >&2
        break
      fi
      sleep 0.2
    done
  fi
  stop_daemons
  echo "local_slurm.sh: stopped the cluster of $dir" >&2
}

"$action"
