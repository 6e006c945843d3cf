"""Real multi-process runs on CPU (`launch/local_multiprocess.sh`, gloo collectives): the
quickstart as 2 processes x 4 devices computes what 1 process x 8 devices does, checkpoints
move between process counts, and a process that dies takes the others down in bounded time.

The one-process reference runs through the same launcher (jax.distributed with one process),
so both sides reduce over gloo: XLA's in-process CPU all-reduce adds the 8 devices' partial
sums in another order than gloo does (a column sum of 8 shards differed in its last bits), so
bit-equality is only defined between runs that use the same collectives.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxrl.run.metrics_log import read_metrics
from tests.launch_env import FAST_COMPILE, SMALL, free_port

pytestmark = pytest.mark.process  # each test starts several `jaxrl` processes

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "launch" / "local_multiprocess.sh"
QUICKSTART = "configs/quickstart.yaml"
# The quickstart as README runs it, over 8 devices (fsdp), 3 steps, without the extras that
# only cost time (FLOP counting, evaluation, plots).
RUN = ["sharding.layout=fsdp", "train.max_steps=3", "train.checkpoint_every=2",
       "perf.count_flops=false", "eval.num_prompts=0", "log.plot=false",
       "log.tensorboard=false", "log.print_every=1"]
TIMING = ("time/", "perf/tokens_per_s", "perf/mfu", "perf/hfu")
TIMEOUT_S = 400
# The tests that are not about 2 x 4 == 1 x 8 run on 4 devices in all (SMALL, 2 per process)
# with one update per step.
LONG_RUN = ["train.max_steps=100000", "algo.num_minibatches=1"]


# Every process of these tests compiles its programs (~40% of a launch's CPU time here):
# FAST_COMPILE; both sides of every comparison run with it.


def _env(log_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAXRL_BIN=str(Path(sys.executable).parent / "jaxrl"), XLA_FLAGS=FAST_COMPILE,
               JAXRL_LOG_DIR=str(log_dir), JAXRL_GRACE_S="30")
    return env


def _launch(processes: int, run_dir: Path, *overrides: str, env: dict | None = None
            ) -> subprocess.Popen:
    return subprocess.Popen(
        [str(LAUNCHER), str(processes), QUICKSTART, *RUN, f"train.run_dir={run_dir}",
         *overrides], cwd=ROOT, env={**_env(run_dir.parent / f"{run_dir.name}-logs"),
                                     **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    return err


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)}
            for r in read_metrics(run_dir / "metrics.jsonl")]


def _params_hash(run_dir: Path) -> str:
    """SHA-256 of the final parameters, as saved (HF safetensors, float32)."""
    return hashlib.sha256((run_dir / "final_model" / "model.safetensors").read_bytes()).hexdigest()


def _rewind(run_dir: Path, copy: Path) -> Path:
    """A copy of a finished 3-step run dir whose newest checkpoint (3) is removed: resuming
    it restores checkpoint 2 and runs step 2 again."""
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("final_model"))
    shutil.rmtree(copy / "checkpoints" / "3")
    return copy


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 3-step quickstart as 1 process x 8 devices and as 2 processes x 4 devices."""
    base = tmp_path_factory.mktemp("multiprocess")
    one, two = _launch(1, base / "one"), _launch(2, base / "two")
    _finish(one)
    err = _finish(two)
    # jaxrl's own account: one 8-device mesh over the 2 processes.
    assert "mesh {'data': 1, 'fsdp': 8, 'tensor': 1} over 2 processes" in err
    return base / "one", base / "two"


def test_two_processes_give_the_metrics_and_parameters_of_one(runs):
    one, two = runs
    got, want = _metrics(two), _metrics(one)
    assert [r["step"] for r in got] == [0, 1, 2]
    assert len(got[0]) >= 15 and "loss/policy" in got[0]
    assert got == want  # every metric but wall-clock times, float for float
    assert _params_hash(two) == _params_hash(one)
    # Only process 0 wrote run files: one metrics line per step.
    assert len(read_metrics(two / "metrics.jsonl")) == 3


def test_checkpoint_of_two_processes_resumes_in_one_and_back(runs, tmp_path):
    """Checkpoint 2 of the 2-process run resumed by 1 process, and of the 1-process run by 2;
    and 2 processes resuming a run whose newest checkpoint only process 1 cannot read: process
    1 alone must not fall back to checkpoint 2 while process 0 goes on from 3, the run stops
    naming the checkpoint to remove (the three resumes run at once)."""
    one, two = runs
    from_two, from_one = _rewind(two, tmp_path / "from_two"), _rewind(one, tmp_path / "from_one")
    damaged = tmp_path / "damaged"
    shutil.copytree(two, damaged, ignore=shutil.ignore_patterns("final_model"))
    shard_files = list((damaged / "checkpoints" / "3" / "model" / "ocdbt.process_1" / "d").iterdir())
    assert shard_files
    for f in shard_files:
        f.write_bytes(f.read_bytes()[:10])
    resumes = [_launch(1, from_two), _launch(2, from_one)]
    refused = _launch(2, damaged, "distributed.heartbeat_timeout_s=10")
    _, err = refused.communicate(timeout=TIMEOUT_S)
    assert refused.returncode != 0
    log = (tmp_path / "damaged-logs" / "process-1.log").read_text()
    assert "process 1 cannot read its part of checkpoint 3" in log, log[-3000:]
    assert f"remove {damaged / 'checkpoints' / '3'}" in log
    # Process 0 waited in orbax's barrier for process 1, which is gone: the health check
    # ended it.
    assert "another task died" in err or "lost contact" in err, err[-3000:]
    assert len(read_metrics(damaged / "metrics.jsonl")) == 3  # nothing ran past the restore
    for process in resumes:
        assert "from the checkpoint at step 2" in _finish(process)
    for resumed in (from_two, from_one):
        assert _metrics(resumed) == _metrics(one)
        assert _params_hash(resumed) == _params_hash(one)


def test_a_dead_process_ends_the_others_with_an_error(tmp_path):
    """SIGKILL one of two processes mid-run: the other must not wait forever in a collective;
    the coordinator's health check ends it within distributed.heartbeat_timeout_s."""
    heartbeat_s, port = 10, free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count=2",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
    processes = [subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "train", QUICKSTART, *RUN, *LONG_RUN,
         "train.checkpoint_every=0",
         f"distributed.heartbeat_timeout_s={heartbeat_s}", f"train.run_dir={tmp_path / 'run'}"],
        cwd=ROOT, env={**env, "JAX_PROCESS_ID": str(i)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True) for i in range(2)]
    survivor, victim = processes
    try:
        metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + TIMEOUT_S
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert survivor.poll() is None and victim.poll() is None, survivor.stderr.read()
            assert time.monotonic() < deadline, "the run did not start in time"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = survivor.communicate(timeout=heartbeat_s * 3 + 15)
        waited = time.monotonic() - killed_at
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert survivor.returncode != 0
    # In a collective with the dead process (gloo sees the connection close): jaxrl's error;
    # elsewhere (compiling, on the host): the health check's, after the heartbeat timeout.
    assert ("lost contact with another process of this run" in err
            or "another task died" in err), err[-3000:]
    assert waited < heartbeat_s * 3 + 15
    print(f"survivor exited {waited:.1f}s after the kill (heartbeat timeout {heartbeat_s}s):\n"
          f"{err[-1500:]}")


def test_python_rewards_are_scored_by_each_process_on_its_own_rows(tmp_path):
    """A custom task with a Python reward: 2 processes (split mode, chosen for them) give the
    metrics, parameters and evaluation of 1 (fused); each process scored only its half of
    every batch, in training and in evaluation, and every sample got its own row's answer."""
    from tests.test_shipped_configs import _tiny_model_dir

    model = _tiny_model_dir(tmp_path / "model", "qwen2")
    data, held_out = tmp_path / "sums.jsonl", tmp_path / "held_out.jsonl"
    for path, first in ((data, range(1, 5)), (held_out, range(5, 7))):
        path.write_text("".join(json.dumps({"prompt": f"Tom has {a} apples and buys {b} more.",
                                            "answer": str(a + b)}) + "\n"
                                for a in first for b in range(10, 14)), encoding="utf-8")
    task = [f"model.path={model}", "data.task=custom", f"data.source={data}",
            "data.fields=[answer]", "data.reward_fn=tests.distributed.reward_probe:own_answer",
            "data.chat_template=false", "data.max_prompt_len=48", "data.batch_size=8",
            "rollout.num_generations=4", "rollout.max_new_tokens=6", "algo.num_minibatches=2",
            "train.max_steps=2", "train.checkpoint_every=0",
            # The final evaluation scores 8 held-out prompts x 1 greedy sample too.
            f"data.eval_source={held_out}", "eval.num_prompts=8", "eval.batch_size=8"]
    launched = {}
    for n in (1, 2):
        probe = tmp_path / f"probe{n}"
        probe.mkdir()
        launched[n] = _launch(n, tmp_path / f"run{n}", *task, env={
            **SMALL, "JAXRL_REWARD_PROBE_DIR": str(probe), "PYTHONPATH": str(ROOT)})
    errors = {n: _finish(p) for n, p in launched.items()}
    assert "algo.mode: split (Python rewards on 2 processes" in errors[2]
    assert _metrics(tmp_path / "run2") == _metrics(tmp_path / "run1")
    assert _params_hash(tmp_path / "run2") == _params_hash(tmp_path / "run1")
    evals = [json.loads((tmp_path / f"run{n}" / "eval.jsonl").read_text()) for n in (1, 2)]
    assert evals[0] == evals[1] and evals[0]["eval/num_prompts"] == 8
    for n in (1, 2):
        logs = sorted((tmp_path / f"probe{n}").glob("*.jsonl"))
        calls = [[json.loads(line) for line in f.read_text().splitlines()] for f in logs]
        assert len(logs) == n  # n processes scored
        # 2 steps x 8 prompts x 4 samples and 8 evaluated, split evenly between processes.
        assert [len(c) for c in calls] == [(2 * 8 * 4 + 8) // n] * n
        assert all(r["matched"] for c in calls for r in c)


def test_sigterm_to_the_launcher_stops_every_process_after_one_step_with_a_checkpoint(tmp_path):
    """A preempted multi-host run: SIGTERM reaches both processes (through the launcher);
    they agree on one step (JAX's preemption service), save one checkpoint together and
    exit 0; the checkpoint is the step after the last metrics line."""
    run = tmp_path / "run"
    launcher = _launch(2, run, *LONG_RUN, "train.checkpoint_every=1000", env=SMALL)
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not start in time"
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err[-3000:]
    steps = len(read_metrics(metrics))
    assert 0 < steps < 100
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [steps]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped_by"] == "SIGTERM" and summary["checkpoint_step"] == steps


@pytest.mark.parametrize(("settings", "staleness"), [
    (["algo.max_staleness=1"], [0, 1, 1]),
    (["algo.max_staleness=2", "rollout.inflight_updates=true"], [0, 1, 2]),
], ids=["k1", "k2-inflight"])
def test_async_mode_over_two_processes_gives_the_metrics_of_one(tmp_path, settings, staleness):
    """algo.mode=async with both sub-meshes spanning the 2 processes (each gives one of its
    two devices to each side): the weights and batches move between the meshes process by
    process (`jaxrl.sharding.submeshes.move`), and the metrics equal one process's; with
    in-flight weight updates too (the rollouts in progress stay on the rollout mesh)."""
    run = ["algo.mode=async", "sharding.rollout_devices=2", *settings,
           "algo.loss.tis_cap=2.0", "algo.num_minibatches=1", "train.save_final=false"]
    one, two = (_launch(n, tmp_path / f"run{n}", *run, env=SMALL) for n in (1, 2))
    _finish(one)
    err = _finish(two)
    assert "2 rollout devices" in err and "over 2 processes" in err
    got, want = _metrics(tmp_path / "run2"), _metrics(tmp_path / "run1")
    assert [r["async/staleness_max"] for r in got] == staleness
    assert got == want
