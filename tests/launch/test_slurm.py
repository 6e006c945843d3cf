"""launch/slurm_gpu.sbatch under a real SLURM scheduler: a one-node cluster started on this
machine for the module (launch/testing/local_slurm.sh), real `sbatch`, `scancel` and
`scontrol requeue`.

Every job runs the script as a cluster without GPUs would: JAX_PLATFORMS=cpu, 2 tasks on the
node, each with the fake CPU devices XLA_FLAGS gives it. What is checked is what the launcher
promises: one jax.distributed run over the tasks whose metrics are those of 1 process x 8
devices; a task that dies ends the job at once; SIGTERM by each of SLURM's three paths (to the
batch shell, to the tasks, to both) leaves a checkpoint of a finished step, and the requeued
job resumes to the uninterrupted run's metrics; DRY_RUN; `jaxrl eval` and `jaxrl bench`
through JAXRL_COMMAND. Nothing of the cluster is left running after the module.

The 1-process references run through launch/local_multiprocess.sh, as in
tests/distributed/test_multiprocess.py (whose helpers these are), so that both sides reduce
over gloo and compare float for float.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from jaxrl.run.metrics_log import read_metrics
from jaxrl.saved.checkpoint import Checkpoints
from tests.distributed.test_multiprocess import (
    FAST_COMPILE,
    QUICKSTART,
    RUN,
    _finish,
    _launch,
    _metrics,
    _params_hash,
)
from tests.launch_env import free_port

pytestmark = pytest.mark.process  # a SLURM cluster and jobs of several jaxrl processes

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "launch" / "slurm_gpu.sbatch"
LOCAL_SLURM = ROOT / "launch" / "testing" / "local_slurm.sh"
# 2 tasks on the one node, 1 CPU each (the node has this machine's CPUs); no GPUs, which the
# script's #SBATCH defaults ask for.
TASKS = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1",
         "--gpus-per-node=0"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")
TIMEOUT_S = 400


@pytest.fixture(scope="module")
def cluster():
    """A one-node SLURM cluster for this module; yields its SLURM_CONF. Skipped, with the
    script's reason, only where it cannot run (not root, or no apt-get for the packages)."""
    state = Path(tempfile.mkdtemp(prefix="jaxrl-slurm-"))  # under /tmp: munged must reach it
    proc = subprocess.run([str(LOCAL_SLURM), "start", str(state)], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode == 3:
        shutil.rmtree(state, ignore_errors=True)
        pytest.skip(proc.stderr.strip())
    try:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"export SLURM_CONF={state / 'slurm.conf'}"
        yield str(state / "slurm.conf")
    finally:
        stopped = subprocess.run([str(LOCAL_SLURM), "stop", str(state)], capture_output=True,
                                 text=True, timeout=180)
        assert stopped.returncode == 0, stopped.stderr
        shutil.rmtree(state, ignore_errors=True)


def _slurm(conf: str, *args: str) -> str:
    """A SLURM client command against the module's cluster; its stdout."""
    proc = subprocess.run(list(args), env={**os.environ, "SLURM_CONF": conf},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(args)}: {proc.stderr}"
    return proc.stdout


def _sbatch(conf: str, log: Path, *args: str, devices: int = 4, env: dict | None = None,
            sbatch: tuple[str, ...] = ()) -> str:
    """Submits slurm_gpu.sbatch with `args` from the repository root (2 tasks of `devices`
    CPU devices each; output to `log`, where a requeued run appends: the script's
    --open-mode=append); returns the job id. sbatch passes on the environment built here,
    none of the test process's JAX_, XLA_ or SLURM_ variables."""
    venv = Path(sys.prefix)
    job_env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8", "SLURM_CONF": conf,
        # The test run's compilation cache: the tasks compile what other tests compiled.
        **{k: v for k, v in os.environ.items() if k.startswith("JAX_PERSISTENT_CACHE")
           or k == "JAX_COMPILATION_CACHE_DIR"},
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}",
        # This venv when it is one, else the jaxrl beside this Python (first on PATH).
        "VENV": str(venv) if (venv / "bin" / "activate").exists() else "",
        # A free port, not the one derived from the job id that another cluster may be using.
        "JAX_COORDINATOR_PORT": str(free_port()),
        **(env or {}),
    }
    cmd = ["sbatch", "--parsable", f"--output={log}", *TASKS, *sbatch, str(SLURM), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job(conf: str, job: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
    fields = _slurm(conf, "scontrol", "--oneliner", "show", "job", job).split()
    return dict(f.split("=", 1) for f in fields if "=" in f)


def _wait_for_end(conf: str, job: str, timeout: float = TIMEOUT_S) -> dict[str, str]:
    """Polls until the job has ended and none of its processes is left (squeue no longer
    lists it: COMPLETING lasts until every process of the job is gone)."""
    deadline = time.monotonic() + timeout
    while _slurm(conf, "squeue", "--noheader", f"--jobs={job}").strip():
        assert time.monotonic() < deadline, f"job {job} still running: {_job(conf, job)}"
        time.sleep(0.2)
    info = _job(conf, job)
    assert info["JobState"] in ENDED, info
    return info


def _wait_for_lines(conf: str, job: str, path: Path, lines: int, log: Path) -> None:
    """Polls until `path` has `lines` lines while the job runs (it is then mid-run)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (path.exists() and path.read_text().count("\n") >= lines):
        info = _job(conf, job)
        assert info["JobState"] in ("PENDING", "RUNNING"), \
            f"job {job} {info['JobState']} ({info['Reason']}): {_tail(log)}"
        assert time.monotonic() < deadline, f"{path} has not {lines} lines: {_tail(log)}"
        time.sleep(0.2)


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text()[-chars:] if log.exists() else f"(no {log})"


def _job_processes(job: str) -> list[str]:
    """This machine's processes that belong to the job (SLURM_JOB_ID in their environment:
    the batch shell, srun, the tasks)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"\0SLURM_JOB_ID={job}\0" in f"\0{environ.read_bytes().decode(errors='replace')}":
                found.append((environ.parent / "cmdline").read_text().replace("\0", " "))
        except OSError:  # ended meanwhile
            pass
    return found


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The reference: the 3-step quickstart (RUN) as 1 process x 8 devices; its run dir."""
    reference = tmp_path_factory.mktemp("slurm-reference") / "one"
    _finish(_launch(1, reference))
    return reference


def test_two_tasks_give_the_metrics_and_parameters_of_one_process(cluster, one_process,
                                                                   tmp_path):
    """sbatch --ntasks=2: one 8-device program over the 2 tasks (jax.distributed from SLURM's
    environment), with the metrics and final parameters of 1 process x 8 devices."""
    log, run = tmp_path / "job.out", tmp_path / "slurm"
    port = str(free_port())
    job = _sbatch(cluster, log, QUICKSTART, *RUN, f"train.run_dir={run}",
                  env={"JAX_COORDINATOR_PORT": port})
    info = _wait_for_end(cluster, job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _tail(log)
    out = log.read_text()
    assert (f"job {job}: 1 nodes, 2 tasks per node, 4 CPU devices per task (JAX_PLATFORMS=cpu),"
            f" coordinator port {port}") in out
    assert "mesh {'data': 1, 'fsdp': 8, 'tensor': 1} over 2 processes" in out
    got, want = _metrics(run), _metrics(one_process)
    assert [r["step"] for r in got] == [0, 1, 2] and "loss/policy" in got[0]
    assert got == want  # every metric but wall-clock times, float for float
    assert _params_hash(run) == _params_hash(one_process)


def test_a_killed_task_ends_the_job_at_once(cluster, tmp_path):
    """SIGKILL to task 1 mid-run (a node or process lost): srun's --kill-on-bad-exit ends task
    0 too, rather than leaving it waiting in a collective; the job fails within 60 s and no
    process of it is left."""
    log, run = tmp_path / "job.out", tmp_path / "run"
    job = _sbatch(cluster, log, QUICKSTART, *RUN, "train.max_steps=100000",
                  "train.checkpoint_every=0", "algo.num_minibatches=1", f"train.run_dir={run}",
                  devices=2)
    _wait_for_lines(cluster, job, run / "metrics.jsonl", 1, log)
    rows = [line.split() for line in _slurm(cluster, "scontrol", "listpids", f"{job}.0")
            .splitlines()[1:]]
    (task1,) = [int(pid) for pid, _, _, _, global_id in rows if global_id == "1"]
    os.kill(task1, signal.SIGKILL)
    killed_at = time.monotonic()
    info = _wait_for_end(cluster, job, timeout=120)
    ended_s = time.monotonic() - killed_at
    print(f"job {job} ended {ended_s:.1f}s after task 1 was killed: {info['JobState']}")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", info
    assert ended_s < 60
    assert "task 1: Killed" in log.read_text(), _tail(log)
    assert _job_processes(job) == []


# The three ways SIGTERM reaches a job, and how the job ends after its tasks saved a step.
STOPS = [
    # the batch shell alone (scancel --batch, --signal=B:TERM@T): it passes SIGTERM on
    (["scancel", "--signal=TERM", "--batch"], "COMPLETED"),
    # the tasks alone (--signal=TERM@T, the start of a preemption's GraceTime)
    (["scancel", "--signal=TERM"], "COMPLETED"),
    # the shell and the tasks, SIGKILL after KillWait (scancel, the end of a GraceTime or of
    # the time limit)
    (["scancel"], "CANCELLED"),
]


def test_term_then_requeue_resumes_to_the_uninterrupted_metrics(cluster, tmp_path):
    """A --requeue job stopped three times, once by each of SLURM's signal paths (STOPS), and
    requeued each time: every time the tasks stop after one step with a checkpoint of it, the
    requeued job resumes from there, and in the end the metrics are the uninterrupted run's."""
    max_steps = 16
    steps = [f"train.max_steps={max_steps}", "train.checkpoint_every=1000",
             "algo.num_minibatches=1", "train.save_final=false"]
    ref_log, log = tmp_path / "reference.out", tmp_path / "job.out"
    reference, run = tmp_path / "reference", tmp_path / "run"
    ref_job = _sbatch(cluster, ref_log, QUICKSTART, *RUN, *steps,
                      f"train.run_dir={reference}", devices=2)
    job = _sbatch(cluster, log, QUICKSTART, *RUN, *steps, f"train.run_dir={run}", devices=2,
                  sbatch=("--requeue",))
    info = _wait_for_end(cluster, ref_job)
    assert info["JobState"] == "COMPLETED", _tail(ref_log)
    metrics = run / "metrics.jsonl"

    stopped_at = [0]
    for stop, state in STOPS:
        # One step past the last stop: the (requeued) run is mid-run.
        _wait_for_lines(cluster, job, metrics, stopped_at[-1] + 1, log)
        _slurm(cluster, *stop, job)
        info = _wait_for_end(cluster, job, timeout=120)
        assert info["JobState"] == state, (stop, info)
        written = len(read_metrics(metrics))
        assert stopped_at[-1] < written < max_steps, _tail(log)  # mid-run, after a step
        assert Checkpoints(run).steps()[-1] == written, _tail(log)
        assert f"stopped after step {written} with a checkpoint" in log.read_text()
        stopped_at.append(written)
        # The job starts again ~11 s later (local_slurm.sh, cred_expire).
        _slurm(cluster, "scontrol", "requeue", job)

    info = _wait_for_end(cluster, job)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", str(len(STOPS))), _tail(log)
    out = log.read_text()
    for step in stopped_at[1:]:
        assert f"resume: from the checkpoint at step {step}" in out
    got = _metrics(run)
    assert [r["step"] for r in got] == list(range(max_steps))
    assert got == _metrics(reference)


def test_dry_run_prints_the_srun_command(cluster, tmp_path):
    log, run = tmp_path / "job.out", tmp_path / "a b"
    job = _sbatch(cluster, log, QUICKSTART, "train.max_steps=3", f"train.run_dir={run}",
                  env={"DRY_RUN": "1"})
    info = _wait_for_end(cluster, job, timeout=60)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _tail(log)
    assert log.read_text().splitlines()[-1] == (
        "srun --kill-on-bad-exit=1 --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1"
        f" --gpu-bind=none jaxrl train {QUICKSTART} train.max_steps=3"
        f" train.run_dir={tmp_path}/a\\ b")
    assert not run.exists()  # nothing ran


def test_eval_over_two_tasks_gives_the_evaluation_of_one_process(cluster, tmp_path):
    """JAXRL_COMMAND=eval: a random policy (a fresh run directory) evaluated by 2 tasks scores
    what 1 process x 8 devices scores, prompt for prompt."""
    evaluate = ["eval.num_prompts=32", "eval.batch_size=16"]
    log, run, reference = tmp_path / "job.out", tmp_path / "slurm", tmp_path / "one"
    job = _sbatch(cluster, log, QUICKSTART, *RUN, *evaluate, f"train.run_dir={run}",
                  env={"JAXRL_COMMAND": "eval"})
    one = _launch(1, reference, *evaluate, env={"JAXRL_COMMAND": "eval"})
    _finish(one)
    info = _wait_for_end(cluster, job)
    assert info["JobState"] == "COMPLETED", _tail(log)
    got, want = ([json.loads(line) for line in (d / "eval.jsonl").read_text().splitlines()]
                 for d in (run, reference))
    assert len(got) == 1 and got[0]["eval/num_prompts"] == 32
    assert got == want


def test_bench_over_two_tasks(cluster, one_process, tmp_path):
    """JAXRL_COMMAND=bench: the step measured over 2 tasks x 4 devices (bench.json), whose
    steps compute what training's first steps compute on 1 process x 8 devices."""
    log, run = tmp_path / "job.out", tmp_path / "slurm"
    job = _sbatch(cluster, log, QUICKSTART, *RUN, f"train.run_dir={run}", "--steps", "2",
                  "--warmup", "1", env={"JAXRL_COMMAND": "bench"})
    info = _wait_for_end(cluster, job)
    assert info["JobState"] == "COMPLETED", _tail(log)
    result = json.loads((run / "bench.json").read_text())
    assert (result["num_processes"], result["num_devices"]) == (2, 8)
    assert (result["warmup"], result["steps"]) == (1, 2) and result["step_s"] > 0
    assert _metrics(run) == _metrics(one_process)
