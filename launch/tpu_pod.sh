#!/usr/bin/env bash
# launch/tpu_pod.sh: run jaxrl on every worker of a Cloud TPU pod slice, or of every slice of a
# TPU multislice, from your own machine through gcloud.
#
# A slice larger than one host (v4-32, v5p-64, v6e-32, ...) is several TPU VMs, its workers;
# JAX wants the same program started on each. This script ships the repository to every
# worker, installs it there and starts the same `jaxrl` command on all of them over
# `gcloud ... ssh --worker=all`. jaxrl then joins the processes itself: on a TPU VM,
# jax.distributed.initialize finds the slice's workers, and on a multislice the slices, from
# the VM's metadata and the MEGASCALE_* environment that queued resources set.
#
#   export TPU_NAME=my-pod ZONE=us-central2-b
#   launch/tpu_pod.sh all configs/grpo_gsm8k_qwen2.5-1.5b.yaml train.run_dir=/mnt/gcs/runs/qwen
#
# Subcommands:
#   create                  create the TPU VM, or with QUEUED_RESOURCE the queued resource
#   copy                    the repository's tracked files, with your uncommitted edits to them
#                           and newly `git add`ed files, to REMOTE_DIR on every worker
#                           (untracked files stay behind; files deleted here stay there)
#   install                 on every worker: REMOTE_DIR/.venv, pip install -e ., jax[tpu]
#   mount                   gcsfuse GCS_BUCKET at MOUNT_DIR on every worker (after copy)
#   train CONFIG [K=V ...]  `jaxrl train CONFIG [overrides]` on every worker (after install)
#   run CMD [ARG ...]       any command on every worker, in REMOTE_DIR with the venv active:
#                           `run jaxrl eval CONFIG ...`, `run jaxrl bench CONFIG ...`
#   stop                    SIGTERM to jaxrl on every worker: it checkpoints and exits (Ctrl-C
#                           here ends the ssh sessions but may leave jaxrl running there)
#   all CONFIG [K=V ...]    copy, install, mount (when GCS_BUCKET is set), train
#   delete                  delete the TPU VM, or the queued resource with its slices
#
# Environment:
#   TPU_NAME          the TPU VM (required unless QUEUED_RESOURCE is set)
#   ZONE              its zone, e.g. us-central2-b (required)
#   PROJECT           the Google Cloud project (default: gcloud's core/project)
#   QUEUED_RESOURCE   a queued resource id: every subcommand then addresses all the workers
#                     of all its slices (`gcloud QR_TRACK compute tpus queued-resources
#                     ssh|scp ID --node=all --worker=all`)
#   QR_TRACK          gcloud release track of the queued-resources commands: alpha (default)
#                     or ga (recent gcloud releases have ssh and scp in both)
#   REMOTE_DIR        the checkout on each worker (default ~/jaxrl, ~ being the worker's home)
#   PYTHON            the interpreter that makes the workers' venv (default python3). jaxrl
#                     needs Python >= 3.11 and several TPU VM images ship 3.10: install one
#                     there (e.g. python3.11 and python3.11-venv) and set PYTHON=python3.11
#   GCS_BUCKET        the bucket `mount` mounts (name or gs://name)
#   MOUNT_DIR         where it appears on every worker (default /mnt/gcs)
#   GCSFUSE_FLAGS     gcsfuse options (default "--implicit-dirs --rename-dir-limit=200000")
#   STREAM            0 (default): only process 0's output streams here, the other workers
#                     write REMOTE_DIR/logs/ and show their last lines only when they fail;
#                     all: every worker's output streams here, prefixed with slice and worker
#   ACCELERATOR_TYPE  for create: e.g. v5p-64, v6e-32 (the shape of one slice)
#   RUNTIME_VERSION   for create: the TPU VM image, e.g. v2-alpha-tpuv5, v2-alpha-tpuv6e
#   NUM_SLICES        for create with QUEUED_RESOURCE: the number of slices (default 1)
#   CREATE_FLAGS      more flags for create, e.g. "--spot" or "--reserved"
#   DRY_RUN=1         print the git and gcloud commands on stdout instead of running them
#                     (only `git stash create`, which names the snapshot, still runs);
#                     otherwise each is printed on stderr, prefixed with +, as it runs
#
# The run directory: only process 0 logs and writes metrics, but every worker writes its own
# checkpoint shards, so train.run_dir must be one directory that every worker sees at the same
# path. On TPU VMs that is a GCS bucket mounted with gcsfuse at the same path everywhere
# (`mount`: GCS_BUCKET=my-bucket, then train.run_dir=/mnt/gcs/runs/NAME) or a Filestore
# (NFS) share. The default --rename-dir-limit lets orbax commit a checkpoint by renaming its
# temporary directory, which gcsfuse refuses otherwise. jaxrl checks the directory at start.
#
# Multislice: several slices joined over the data-center network (DCN) need a queued
# resource, made by `create` with QUEUED_RESOURCE, ACCELERATOR_TYPE, RUNTIME_VERSION and
# NUM_SLICES > 1 (`queued-resources create ID --node-count=N --node-prefix=NAME`; NAME is
# TPU_NAME, else the id). Wait until `gcloud compute tpus queued-resources describe ID
# --zone=ZONE` says ACTIVE, then copy, install and train as above. The sharding layout must
# say how many slices there are: its dcn.data must equal NUM_SLICES. Copy
# sharding/dp_fsdp_tp.yaml (data across slices, fsdp and tensor within one), set
# `dcn: {data: N}`, `git add` it so that copy ships it, and pass sharding.layout=PATH.
#
# Steps: `copy` runs `git stash create` (a commit of the working tree that touches neither the
# branch nor the stash list), `git archive`s it, scp's the tarball to every worker's home
# and unpacks it into REMOTE_DIR. install, mount and train/run ssh into every worker and run
# this same script there (`bash launch/tpu_pod.sh _install|_mount|_run`, from the copy), so
# the code that runs on the workers is the code they received. Each worker runs one process,
# over its host's TPU chips; gcloud starts them all at once (--batch-size=all for queued
# resources, whose default batches of 64 workers would wait forever for the rest).
#
# Before the first run: gcloud needs your SSH key loaded to reach many workers at once
# (`ssh-add ~/.ssh/google_compute_engine`, made by a first `gcloud compute tpus tpu-vm ssh`).
# Needs bash >= 4.4 here (macOS: `brew install bash`); the workers run bash too.
set -euo pipefail

if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then
  echo "tpu_pod.sh: needs bash >= 4.4, this is $BASH_VERSION (macOS: brew install bash)" >&2
  exit 2
fi

# Where this script lives inside the repository: the workers run it from their copy.
SCRIPT_IN_REPO=launch/tpu_pod.sh
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The tarball's name in each worker's home, between scp and unpacking.
TARBALL=jaxrl-src.tar.gz

die() {
  printf 'tpu_pod.sh: error: %s\n' "$*" >&2
  exit 2
}

note() {
  printf 'tpu_pod.sh: %s\n' "$*" >&2
}

usage() {
  # The header comment, without its leading '#'.
  awk 'NR == 1 { next } !/^#/ { exit } { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"
}

dry_run() {
  [[ -n ${DRY_RUN:-} && ${DRY_RUN} != 0 ]]
}

# One argument as the shell would need it typed: bare when it is a plain word, else
# single-quoted (after the = of a --flag=value), so that a printed command can be pasted
# back into a shell.
shown() {
  local escaped="'\\''"
  if [[ $1 =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  elif [[ $1 =~ ^(--[A-Za-z0-9-]+=)(.*)$ ]]; then
    printf "%s'%s'" "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]//\'/$escaped}"
  else
    printf "'%s'" "${1//\'/$escaped}"
  fi
}

# Prints a command, then runs it (DRY_RUN: only prints it, on stdout).
run() {
  local line="+" arg
  for arg in "$@"; do
    line+=" $(shown "$arg")"
  done
  if dry_run; then
    printf '%s\n' "${line#+ }"
    return 0
  fi
  printf '%s\n' "$line" >&2
  "$@"
}

# Every argument quoted for the workers' shell, joined by spaces.
quoted() {
  local out
  printf -v out ' %q' "$@"
  printf '%s' "${out# }"
}

# REMOTE_DIR for the workers' shell: a leading ~ stays unquoted so that it expands there, to
# the worker's home, not here.
# shellcheck disable=SC2088  # the ~ is meant literally: the workers expand it
remote_dir() {
  local dir=${REMOTE_DIR:-"~/jaxrl"}
  case $dir in
    "~") printf '~' ;;
    "~/"*) printf '~/%s' "$(quoted "${dir#"~/"}")" ;;
    *) printf '%s' "$(quoted "$dir")" ;;
  esac
}

# Sets GCLOUD_TPU (the gcloud command group), TARGET (the TPU or queued resource), WHERE (zone
# and project flags) and ALL_WORKERS (the flags that address every worker), or names what is
# missing.
select_target() {
  local missing=()
  if [[ -n ${QUEUED_RESOURCE:-} ]]; then
    case ${QR_TRACK:-alpha} in
      alpha) GCLOUD_TPU=(gcloud alpha compute tpus queued-resources) ;;
      ga) GCLOUD_TPU=(gcloud compute tpus queued-resources) ;;
      *) die "QR_TRACK must be alpha or ga, not '$QR_TRACK'" ;;
    esac
    TARGET=$QUEUED_RESOURCE
    ALL_WORKERS=(--node=all --worker=all)
  else
    [[ -n ${TPU_NAME:-} ]] || missing+=("TPU_NAME (the TPU VM's name; or QUEUED_RESOURCE for a queued resource)")
    GCLOUD_TPU=(gcloud compute tpus tpu-vm)
    TARGET=${TPU_NAME:-}
    ALL_WORKERS=(--worker=all)
  fi
  [[ -n ${ZONE:-} ]] || missing+=("ZONE (the TPU's zone, e.g. us-central2-b)")
  if ((${#missing[@]})); then
    local IFS=';'
    die "not set: ${missing[*]}"
  fi
  WHERE=(--zone="$ZONE")
  [[ -z ${PROJECT:-} ]] || WHERE+=(--project="$PROJECT")
}

# The same command on every worker, at once. Queued resources batch their ssh sessions 64 at
# a time by default: a training run's first 64 processes would then wait forever for the rest.
ssh_all() {
  local batch=()
  [[ -z ${QUEUED_RESOURCE:-} ]] || batch=(--batch-size=all)
  run "${GCLOUD_TPU[@]}" ssh "$TARGET" "${WHERE[@]}" "${ALL_WORKERS[@]}" "${batch[@]}" \
    --command="$1"
}

# A commit of the working tree's tracked files (uncommitted edits and staged new files
# included) that changes neither the branch nor the stash list; HEAD when nothing changed.
# The identity is only needed to make that commit object, which nothing keeps.
snapshot() {
  local rev
  git -C "$REPO_ROOT" rev-parse --git-dir >/dev/null 2>&1 ||
    die "$REPO_ROOT is not a git checkout: copy ships what git tracks"
  rev=$(GIT_AUTHOR_NAME=tpu_pod GIT_AUTHOR_EMAIL=tpu_pod@localhost \
    GIT_COMMITTER_NAME=tpu_pod GIT_COMMITTER_EMAIL=tpu_pod@localhost \
    git -C "$REPO_ROOT" stash create) || die "git stash create failed in $REPO_ROOT"
  printf '%s\n' "${rev:-HEAD}"
}

# Warns when CONFIG is a file of this checkout that copy does not ship (not tracked by git).
check_shipped() {
  local path=$1
  if [[ -f $REPO_ROOT/$path ]]; then
    git -C "$REPO_ROOT" ls-files --error-unmatch -- "$path" >/dev/null 2>&1 ||
      note "warning: $path is not tracked by git, so copy does not ship it: git add it and copy again"
  elif [[ $path != /* ]]; then
    note "warning: $path is not in $REPO_ROOT; it must exist under REMOTE_DIR on every worker"
  fi
}

cmd_create() {
  select_target
  local missing=() name
  for name in ACCELERATOR_TYPE RUNTIME_VERSION; do
    [[ -n ${!name:-} ]] || missing+=("$name")
  done
  ((${#missing[@]} == 0)) || die "create needs: ${missing[*]} (e.g. ACCELERATOR_TYPE=v5p-64 RUNTIME_VERSION=v2-alpha-tpuv5)"
  local slices=${NUM_SLICES:-1}
  [[ $slices =~ ^[1-9][0-9]*$ ]] || die "NUM_SLICES must be a positive integer, not '$slices'"
  local extra=()
  read -r -a extra <<<"${CREATE_FLAGS:-}"
  if [[ -z ${QUEUED_RESOURCE:-} ]]; then
    ((slices == 1)) || die "NUM_SLICES=$slices: a multislice needs a queued resource, set QUEUED_RESOURCE"
    run gcloud compute tpus tpu-vm create "$TPU_NAME" "${WHERE[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${extra[@]}"
    return
  fi
  local node=${TPU_NAME:-$QUEUED_RESOURCE} nodes
  # gcloud takes --node-count only above 1; one slice is a single named node.
  if ((slices > 1)); then
    nodes=(--node-count="$slices" --node-prefix="$node")
  else
    nodes=(--node-id="$node")
  fi
  run "${GCLOUD_TPU[@]}" create "$QUEUED_RESOURCE" "${WHERE[@]}" \
    --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
    "${nodes[@]}" "${extra[@]}"
  note "queued: wait for state ACTIVE (gcloud compute tpus queued-resources describe $QUEUED_RESOURCE --zone=$ZONE)"
  if ((slices > 1)); then
    note "multislice: the sharding layout's dcn.data must be $slices (see the header of $0)"
  fi
}

cmd_delete() {
  select_target
  if [[ -n ${QUEUED_RESOURCE:-} ]]; then
    # --force deletes the slices too; without it gcloud refuses while they exist.
    run "${GCLOUD_TPU[@]}" delete "$QUEUED_RESOURCE" "${WHERE[@]}" --force
  else
    run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${WHERE[@]}"
  fi
}

cmd_copy() {
  select_target
  local rev tmp dir
  rev=$(snapshot)
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/tpu_pod.XXXXXX")
  # shellcheck disable=SC2064  # expand $tmp now: it is local to this function
  trap "rm -rf '$tmp'" EXIT
  run git -C "$REPO_ROOT" archive --format=tar.gz --output="$tmp/$TARBALL" "$rev"
  run "${GCLOUD_TPU[@]}" scp "$tmp/$TARBALL" "$TARGET:$TARBALL" "${WHERE[@]}" "${ALL_WORKERS[@]}"
  rm -rf "$tmp"
  dir=$(remote_dir)
  # Unpacked over the previous copy: the venv stays, so install need not run again.
  ssh_all "mkdir -p $dir && tar -xzf $TARBALL -C $dir && rm -f $TARBALL"
}

cmd_install() {
  select_target
  local env=""
  [[ -z ${PYTHON:-} ]] || env="PYTHON=$(quoted "$PYTHON") "
  ssh_all "cd $(remote_dir) && ${env}bash $SCRIPT_IN_REPO _install"
}

cmd_mount() {
  select_target
  [[ -n ${GCS_BUCKET:-} ]] || die "not set: GCS_BUCKET (the bucket to mount, name or gs://name)"
  local bucket=${GCS_BUCKET#gs://} flags=()
  bucket=${bucket%/}
  read -r -a flags <<<"${GCSFUSE_FLAGS:---implicit-dirs --rename-dir-limit=200000}"
  ssh_all "cd $(remote_dir) && bash $SCRIPT_IN_REPO _mount $(quoted "$bucket" "${MOUNT_DIR:-/mnt/gcs}" "${flags[@]}")"
}

cmd_run() {
  (($# > 0)) || die "run needs a command, e.g. run jaxrl eval CONFIG [overrides]"
  select_target
  local env=""
  [[ ${STREAM:-0} != all ]] || env="STREAM=all "
  ssh_all "cd $(remote_dir) && ${env}bash $SCRIPT_IN_REPO _run $(quoted "$@")"
}

# CONFIG [overrides]: refuses a missing CONFIG before anything runs.
check_config_arg() {
  (($# > 0)) || die "no CONFIG given: train|all CONFIG.yaml [dotted.key=value ...]"
  [[ $1 != *=* ]] || die "the first argument is the CONFIG file, not an override ('$1')"
}

cmd_train() {
  check_config_arg "$@"
  check_shipped "$1"
  if [[ -n ${QUEUED_RESOURCE:-} ]]; then
    note "multislice: the sharding layout's dcn.data must equal the number of slices"
  fi
  cmd_run jaxrl train "$@"
}

cmd_stop() {
  select_target
  # [j]axrl: a pattern that does not match the command line of the shell running pkill.
  ssh_all "if pkill -TERM -f '[.]venv/bin/[j]axrl'; then echo \"\$(hostname): SIGTERM sent to jaxrl\"; else echo \"\$(hostname): no jaxrl running\"; fi"
}

cmd_all() {
  check_config_arg "$@"
  cmd_copy
  cmd_install
  [[ -z ${GCS_BUCKET:-} ]] || cmd_mount
  cmd_train "$@"
}

# --- What runs on each worker (from its copy, in REMOTE_DIR) ---------------------------------

# An attribute of this TPU VM from the metadata server, the source JAX reads too.
tpu_metadata() {
  curl -sf --max-time 10 -H 'Metadata-Flavor: Google' \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}

# This worker's index within its slice, and its slice's index (0 outside multislice); both 0
# off a TPU VM, where every process then streams its output.
worker_position() {
  local worker slice
  worker=$(tpu_metadata agent-worker-number 2>/dev/null) || worker=0
  if [[ -n ${MEGASCALE_SLICE_ID:-} ]]; then
    slice=$MEGASCALE_SLICE_ID
  else
    # tpu-env holds lines such as  MEGASCALE_SLICE_ID: '1'
    slice=$(tpu_metadata tpu-env 2>/dev/null |
      sed -n "s/^MEGASCALE_SLICE_ID: *'\{0,1\}\([0-9]*\)'\{0,1\} *$/\1/p") || slice=0
  fi
  printf '%s %s\n' "${slice:-0}" "${worker:-0}"
}

worker_activate() {
  [[ -f .venv/bin/activate ]] ||
    die "$(hostname): no .venv in $PWD: run 'launch/tpu_pod.sh install' first"
  # shellcheck disable=SC1091  # made by install, on the worker
  . .venv/bin/activate
}

# _run CMD...: process 0 (worker 0 of slice 0) streams; the others log to logs/ and, should
# they fail, show the end of their log. Every process keeps its log in logs/.
worker_run() {
  worker_activate
  # Python block-buffers a pipe: without this the stream would arrive in lumps.
  export PYTHONUNBUFFERED=1
  local slice worker log status=0
  read -r slice worker < <(worker_position)
  mkdir -p logs
  log=logs/slice$slice-worker$worker.log
  if [[ $slice == 0 && $worker == 0 ]]; then
    "$@" 2>&1 | tee "$log"
  elif [[ ${STREAM:-0} == all ]]; then
    "$@" 2>&1 | tee "$log" | sed -u "s/^/[slice $slice worker $worker] /"
  else
    "$@" >"$log" 2>&1 || status=$?
    if ((status != 0)); then
      {
        echo "[slice $slice worker $worker] exited with status $status; the end of $PWD/$log:"
        tail -n 30 "$log" | sed "s/^/[slice $slice worker $worker] /"
      } >&2
    fi
    return "$status"
  fi
}

worker_install() {
  local py=${PYTHON:-python3} host
  host=$(hostname)
  command -v "$py" >/dev/null || die "$host: $py not found (set PYTHON to a Python >= 3.11)"
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    die "$host: jaxrl needs Python >= 3.11 and $py is $("$py" -V 2>&1): install one there (e.g. python3.11 and python3.11-venv) and set PYTHON=python3.11"
  # A venv without pip (python3-venv missing when it was made) is made again.
  if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    rm -rf .venv
    "$py" -m venv .venv ||
      die "$host: '$py -m venv' failed: install its venv module (e.g. sudo apt-get install -y python3.11-venv)"
  fi
  worker_activate
  python -m pip install -q -U pip
  python -m pip install -q -e .
  # After jaxrl, whose requirements bring the CPU-only jax: this adds the TPU runtime (libtpu).
  python -m pip install -q -U "jax[tpu]"
  echo "$host: $(python -c 'import jax, jaxrl; print(f"jaxrl {jaxrl.__version__}, jax {jax.__version__}")')"
}

# _mount BUCKET DIR [GCSFUSE FLAGS...]
worker_mount() {
  local bucket=$1 dir=$2 host
  shift 2
  host=$(hostname)
  if mountpoint -q "$dir"; then
    echo "$host: $dir is mounted already"
    return
  fi
  if ! command -v gcsfuse >/dev/null; then
    # Google's apt repository, one per Ubuntu release. A fresh VM's unattended upgrades may
    # hold the dpkg lock for a while: wait for it rather than fail.
    local release
    release=$(lsb_release -cs)
    curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg |
      sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
    echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$release main" |
      sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
    sudo apt-get -o DPkg::Lock::Timeout=600 update -q
    sudo apt-get -o DPkg::Lock::Timeout=600 install -y -q gcsfuse
  fi
  sudo mkdir -p "$dir"
  sudo chown "$(id -u):$(id -g)" "$dir"
  gcsfuse "$@" "$bucket" "$dir"
  echo "$host: gs://$bucket mounted at $dir"
}

main() {
  local sub=${1:-}
  (($# == 0)) || shift
  case $sub in
    create) cmd_create "$@" ;;
    delete) cmd_delete "$@" ;;
    copy) cmd_copy "$@" ;;
    install) cmd_install "$@" ;;
    mount) cmd_mount "$@" ;;
    train) cmd_train "$@" ;;
    run) cmd_run "$@" ;;
    stop) cmd_stop "$@" ;;
    all) cmd_all "$@" ;;
    _run) worker_run "$@" ;;
    _install) worker_install "$@" ;;
    _mount) worker_mount "$@" ;;
    help | -h | --help) usage ;;
    "")
      usage >&2
      die "no subcommand given"
      ;;
    *) die "unknown subcommand '$sub' (one of: create copy install mount train run stop all delete)" ;;
  esac
}

main "$@"
