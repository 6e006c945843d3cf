#!/usr/bin/env bash
# Run one jaxrl command as N processes on this machine, on CPU: a rehearsal of a multi-host
# run (every process runs the same program over one global mesh, as hosts of a TPU pod or a
# GPU cluster do), and what the multi-process tests use.
#
#   launch/local_multiprocess.sh N CONFIG [dotted.key=value ...]
#   launch/local_multiprocess.sh 2 configs/quickstart.yaml sharding.layout=fsdp train.max_steps=50
#
# Each process gets JAXRL_CPU_DEVICES / N fake CPU devices (XLA's host-platform device
# count) and joins the others through jax.distributed: process 0 is the coordinator on
# 127.0.0.1, and the processes' collectives go over gloo (TCP). The quickstart's layout,
# `single`, needs one device in all: give a layout that spans devices (fsdp, dp_fsdp_tp).
#
# Environment:
#   JAXRL_CPU_DEVICES  fake CPU devices in all, split evenly over the processes (default 8)
#   JAXRL_COMMAND      the jaxrl command every process runs: train, eval or bench (default train)
#   JAXRL_BIN          the jaxrl executable (default: `jaxrl` on PATH)
#   JAXRL_PORT         the coordinator's port (default: a free one)
#   JAXRL_LOG_DIR      where processes 1..N-1 write their output, process-<i>.log (default: a
#                      new temporary directory); process 0's output comes to this terminal
#   JAXRL_GRACE_S      after one process fails, seconds the others get to exit on their own
#                      (JAX's health check ends them within distributed.heartbeat_timeout_s,
#                      default 100) before they are killed (default 120)
#
# Exit status: 0 when every process succeeds, else the status of the first that failed (its
# log's last lines are shown). SIGTERM, and Ctrl-C, reach every process as SIGTERM: a training
# run stops after a step, all processes after the same one, with a checkpoint (as on a
# preempted cluster), and exits 0; a second Ctrl-C kills them.
set -euo pipefail

usage() {
  echo "usage: $0 N CONFIG [dotted.key=value ...]  (N processes on this machine, CPU)" >&2
  exit 2
}

[[ $# -ge 2 ]] || usage
num_processes=$1
shift
if ! [[ $num_processes =~ ^[1-9][0-9]*$ ]]; then
  echo "error: N must be a positive integer, got '$num_processes'" >&2
  usage
fi
config=$1
[[ -f $config ]] || { echo "error: config file '$config' does not exist" >&2; exit 2; }

devices=${JAXRL_CPU_DEVICES:-8}
if ! [[ $devices =~ ^[1-9][0-9]*$ ]] || ((devices % num_processes)); then
  echo "error: JAXRL_CPU_DEVICES=$devices must be a positive multiple of N=$num_processes" >&2
  exit 2
fi
per_process=$((devices / num_processes))
command=${JAXRL_COMMAND:-train}
case $command in
  train | eval | bench) ;;
  *) echo "error: JAXRL_COMMAND must be train, eval or bench, got '$command'" >&2; exit 2 ;;
esac
jaxrl_bin=${JAXRL_BIN:-jaxrl}
grace=${JAXRL_GRACE_S:-120}
command -v "$jaxrl_bin" >/dev/null || {
  echo "error: '$jaxrl_bin' not found; activate the venv (. .venv/bin/activate) or set JAXRL_BIN" >&2
  exit 2
}
port=${JAXRL_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
log_dir=${JAXRL_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/jaxrl-processes.XXXXXX")}
mkdir -p "$log_dir"

# The caller's XLA flags, without a device count of its own: each process sets its share.
xla_flags=$(sed -E 's/--xla_force_host_platform_device_count=[^ ]*//g' <<<"${XLA_FLAGS:-}")

pids=()
for ((i = 0; i < num_processes; i++)); do
  env_vars=(
    JAX_PLATFORMS=cpu
    "XLA_FLAGS=$xla_flags --xla_force_host_platform_device_count=$per_process"
    "JAX_COORDINATOR_ADDRESS=127.0.0.1:$port"
    "JAX_NUM_PROCESSES=$num_processes"
    "JAX_PROCESS_ID=$i"
  )
  if ((i == 0)); then
    env "${env_vars[@]}" "$jaxrl_bin" "$command" "$@" &
  else
    env "${env_vars[@]}" "$jaxrl_bin" "$command" "$@" >"$log_dir/process-$i.log" 2>&1 &
  fi
  pids+=($!)
done
if ((num_processes > 1)); then
  others="processes 1..$((num_processes - 1)) log"
  ((num_processes > 2)) || others="process 1 logs"
  echo "local_multiprocess: $num_processes processes x $per_process CPU devices, coordinator" \
    "127.0.0.1:$port; $others to $log_dir" >&2
fi

# Background processes of a script ignore SIGINT, so Ctrl-C is passed on as SIGTERM (jaxrl
# stops after a step with a checkpoint); a second Ctrl-C kills them.
interrupts=0
# shellcheck disable=SC2329  # called by the traps below
forward() {
  if [[ $1 == INT ]]; then
    interrupts=$((interrupts + 1))
    if ((interrupts > 1)); then
      kill -KILL "${pids[@]}" 2>/dev/null || true
      return
    fi
    echo "local_multiprocess: stopping after the current step (Ctrl-C again to kill)" >&2
  fi
  kill -TERM "${pids[@]}" 2>/dev/null || true
}
trap 'forward INT' INT
trap 'forward TERM' TERM

status=0
killer=""
declare -A running # pid -> process index
for ((i = 0; i < num_processes; i++)); do
  running[${pids[i]}]=$i
done
while ((${#running[@]} > 0)); do
  finished=""
  set +e
  wait -n -p finished "${!running[@]}"
  rc=$?
  set -e
  [[ -n ${finished:-} ]] || continue # a trapped signal interrupted wait (it unsets finished)
  i=${running[$finished]}
  unset "running[$finished]"
  remaining=${#running[@]}
  if ((rc != 0 && status == 0)); then
    status=$rc
    echo "local_multiprocess: process $i exited with status $rc" >&2
    if ((i > 0)); then
      echo "--- last lines of $log_dir/process-$i.log" >&2
      tail -n 20 "$log_dir/process-$i.log" >&2 || true
    fi
    if ((remaining > 0)); then
      echo "local_multiprocess: the other processes get ${grace}s to exit before they are killed" >&2
      (sleep "$grace" && kill -KILL "${!running[@]}" 2>/dev/null) &
      killer=$!
    fi
  fi
done
if [[ -n $killer ]]; then
  kill "$killer" 2>/dev/null || true
fi
exit "$status"
