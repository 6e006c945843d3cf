"""Crashes and preemption, with real processes and real signals: a run killed with SIGKILL
resumes to the same metrics as an uninterrupted run; SIGTERM ends a run with a checkpoint and
exit status 0; a damaged newest checkpoint is moved aside with a warning on the console, and
the run goes on from the one before."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxrl.run.metrics_log import read_metrics
from jaxrl.saved.checkpoint import Checkpoints

pytestmark = pytest.mark.process  # each test starts `jaxrl train` and signals it

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
# The quickstart on one device (as README runs it), smaller and without the slow extras.
FAST = ["data.num_prompts=256", "data.batch_size=16", "perf.count_flops=false",
        "log.plot=false", "log.tensorboard=false", "train.save_final=false",
        "eval.num_prompts=0", "log.print_every=1"]
# Wall-clock measurements differ between two runs of the same steps; nothing else may.
TIMING = ("time/", "perf/tokens_per_s", "perf/mfu", "perf/hfu")


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    return subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "train", QUICKSTART, f"train.run_dir={run_dir}",
         *FAST, *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return out, err


def _wait_for_steps(process: subprocess.Popen, run_dir: Path, steps: int) -> None:
    """Polls until `steps` metric lines are written (the process is then mid-run)."""
    path, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (path.exists() and path.read_text().count("\n") >= steps):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.01)


def _without_timing(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def test_sigkill_then_resume_gives_the_uninterrupted_metrics(tmp_path):
    steps = ["train.max_steps=30", "train.checkpoint_every=5", "data.curriculum=pass_rate"]
    reference = _start(tmp_path / "reference", *steps)
    killed = _start(tmp_path / "killed", *steps)
    _wait_for_steps(killed, tmp_path / "killed", 12)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL  # killed mid-run, not finished
    written = len(read_metrics(tmp_path / "killed" / "metrics.jsonl"))
    assert 12 <= written < 30

    _, err = _finish(_start(tmp_path / "killed", *steps))
    _finish(reference)
    # The newest checkpoint whose asynchronous write had finished before the kill (the save of
    # a later one may have been cut short: it does not count).
    resumed_at = int(err.split("from the checkpoint at step ")[1].split()[0])
    assert 5 <= resumed_at <= written and resumed_at % 5 == 0
    want = read_metrics(tmp_path / "reference" / "metrics.jsonl")
    got = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(30))
    # Bitwise: the same floats, for every step and every metric but wall-clock times.
    assert _without_timing(got) == _without_timing(want)
    assert "curriculum/mean_pass_rate" in got[-1]


def test_sigterm_saves_a_checkpoint_and_exits_zero(tmp_path):
    process = _start(tmp_path, "train.max_steps=100000", "train.checkpoint_every=1000")
    _wait_for_steps(process, tmp_path, 5)
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, err = _finish(process, timeout=120)
    assert time.monotonic() - sent < 60  # one step and one small save, not the whole run
    summary = json.loads(out.strip().splitlines()[-1])
    records = read_metrics(tmp_path / "metrics.jsonl")
    # Every step that ran has its metrics, and the checkpoint is at the step after the last.
    assert summary["stopped_by"] == "SIGTERM"
    assert summary["checkpoint_step"] == len(records) < 100000
    assert [r["step"] for r in records] == list(range(len(records)))
    assert Checkpoints(tmp_path).steps() == [len(records)]
    assert "run the same command to resume" in err


def test_ctrl_c_saves_a_checkpoint_and_exits_130_and_twice_stops_at_once(tmp_path):
    process = _start(tmp_path, "train.max_steps=100000", "train.checkpoint_every=1000")
    _wait_for_steps(process, tmp_path, 5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    summary = json.loads(out.strip().splitlines()[-1])
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stopped_by"] == "SIGINT"
    assert summary["checkpoint_step"] == len(records)
    assert Checkpoints(tmp_path).steps() == [len(records)]
    assert f"checkpoint ({tmp_path / 'checkpoints' / str(len(records))})" in err

    # Resumed, then two Ctrl-Cs in a row: the second does not wait for the step and the save.
    process = _start(tmp_path, "train.max_steps=100000", "train.checkpoint_every=1000")
    _wait_for_steps(process, tmp_path, len(records) + 5)
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err


def test_a_damaged_checkpoint_is_moved_aside_then_its_step_saved_again(tmp_path):
    every = "train.checkpoint_every=2"
    _finish(_start(tmp_path, "train.max_steps=4", every))
    assert Checkpoints(tmp_path).steps() == [2, 4]
    garbled = '{"step": 4, "key": ['  # checkpoint 4's JSON meta, cut short
    (tmp_path / "checkpoints" / "4" / "meta" / "metadata").write_text(garbled)

    # The warning reaches the console, naming the step, the error and where the step went.
    _, err = _finish(_start(tmp_path, "train.max_steps=6", every))
    moved = tmp_path / "checkpoints_damaged" / "4"
    warning = next(line for line in err.splitlines() if "cannot be read" in line)
    assert "checkpoint 4" in warning and str(moved) in warning and "JSONDecodeError" in warning
    assert "from the checkpoint at step 2" in err
    assert (moved / "meta" / "metadata").read_text() == garbled
    # Step 4 was saved again (its old folder is gone from checkpoints/), and the run went on
    # (a later start reading the new step 4 or 6: test_checkpoint.py).
    assert Checkpoints(tmp_path).steps() == [2, 4, 6]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(6))
