"""A user's environment (`data.env`) that fails or breaks its contract ends the run with one
line naming the `data.env` spec, the row and turn, and the contract broken: exit 2 when found
before the first step (nothing run, no run directory left), 1 during a step; one `jaxrl train`
of each here. What each failure says is tested where it is found: the builder and the first
row's factory in tests/run/test_episodes.py, each answer's contract in tests/envs/test_base.py,
a raising step, a broken answer and a factory failing on a later row in the rollout
(tests/step/test_multiturn_rollout.py). A hung environment is ended by `data.env_timeout_s`,
and Ctrl-C / SIGTERM work while environments run (the `process` tests, each a real
`jaxrl train`)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxrl.cli import EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, EXIT_TRAINING_FAILED, main
from jaxrl.run.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
ENVS = "tests.envs.hostile_envs"
RUN = ["train.max_steps=2", "rollout.max_turns=2", "data.batch_size=4",
       "rollout.num_generations=4", "algo.num_minibatches=2", "eval.num_prompts=0",
       "log.tensorboard=false", "log.plot=false", "perf.count_flops=false",
       "train.save_final=false"]


@pytest.mark.parametrize("env, status, words", [
    pytest.param("raising_factory", EXIT_CONFIG_ERROR,
                 ["config error", "dataset row 0 (sample 0 of the batch): the factory "
                  "(row -> Environment) raised KeyError: 'question'"], id="before_step_0"),
    pytest.param("raising_step", EXIT_TRAINING_FAILED,
                 ["environment failed", "dataset row", "of the batch), turn 1: "
                  "env.step(turn) raised ValueError: simulator crashed"], id="during_a_step"),
])
def test_a_broken_environment_ends_the_run_naming_spec_row_turn_and_contract(
        env, status, words, tmp_path, capsys):
    run_dir = tmp_path / "r"
    code = main(["train", QUICKSTART, f"train.run_dir={run_dir}", f"data.env={ENVS}:{env}",
                 *RUN])
    err = capsys.readouterr().err
    assert code == status, err
    lines = [line for line in err.splitlines() if "error" in line or "failed" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    text = lines[0]
    assert f"data.env='{ENVS}:{env}'" in text, text
    for word in words:
        assert word in text, (word, text)
    if status == EXIT_CONFIG_ERROR:
        assert not run_dir.exists()


def _train(tmp_path, env, *overrides):
    """`jaxrl train` of the quickstart with `data.env=...:env` as a process; the file that
    appears once an environment step runs."""
    started = tmp_path / "env-started"
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "train", QUICKSTART,
         f"train.run_dir={tmp_path / 'r'}", f"data.env={ENVS}:{env}", *RUN, *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
             "JAXRL_TEST_ENV_STARTED": str(started)})
    return process, started


def _wait_for(path: Path, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no environment step started"
        time.sleep(0.1)


@pytest.mark.process
def test_a_hung_environment_is_ended_by_the_time_limit(tmp_path):
    process, _ = _train(tmp_path, "hanging", "data.env_timeout_s=3")
    try:
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == EXIT_TRAINING_FAILED, err[-3000:]
    text = " ".join(err.split())
    assert f"environment failed: data.env='{ENVS}:hanging'" in text, text
    assert "turn 1: env.step(turn) did not return within the time limit " \
           "(data.env_timeout_s=3;" in text, text


@pytest.mark.process
def test_two_ctrl_c_stop_a_run_whose_environment_hangs(tmp_path):
    process, started = _train(tmp_path, "hanging")  # the time limit (120 s) far off
    try:
        _wait_for(started, process)
        process.send_signal(signal.SIGINT)
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert "interrupted" in err


@pytest.mark.process
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 0), (signal.SIGINT, EXIT_INTERRUPTED)])
def test_a_stop_while_environments_run_stops_after_the_step_with_a_checkpoint(tmp_path, sig,
                                                                             status):
    process, started = _train(tmp_path, "slow", "train.max_steps=50")
    try:
        _wait_for(started, process)
        process.send_signal(sig)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == status, err[-3000:]
    assert f"{sig.name}: stopped after step 1 with a checkpoint" in " ".join(err.split()), err
    assert [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [0]
    assert (tmp_path / "r" / "checkpoints" / "1").is_dir()
