"""algo.mode=async as a config runs it, on 8 CPU devices split 4 rollout + 4 train: staleness
0 gives the synchronous fused run's metrics; a SIGKILLed async run resumes (its queue of
batches made ahead restored) to the uninterrupted run's metrics; bad settings are refused."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from jaxrl.config import ConfigError, ExperimentConfig, RunDirError, load_config
from jaxrl.run import loop
from jaxrl.run.metrics_log import read_metrics
from jaxrl.saved.checkpoint import Checkpoints
from tests.run.test_loop import PHASE_TIMES, _console
from tests.run.test_resume import _finish, _wait_for_steps, _without_timing
from tests.test_shipped_configs import ROOT

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SMALL = ["data.batch_size=8", "data.num_prompts=64", "rollout.num_generations=4",
         "algo.num_minibatches=2", "algo.num_iterations=1", "eval.num_prompts=0",
         "log.print_every=1", "log.plot=false", "log.tensorboard=false",
         "train.save_final=false", "perf.count_flops=false"]
ASYNC = ["algo.mode=async", "sharding.rollout_devices=4"]
LEARN_STEPS = 1400  # async k=2 reached 0.8 at step 1,176 (benchmarks/README.md)
# Not compared between runs: wall-clock times, and what only the async mode reports.
TIMING = ("time/", "perf/tokens_per_s", "perf/mfu", "perf/hfu")


def _train(tmp_path, name, *overrides):
    cfg = load_config(ExperimentConfig, QUICKSTART,
                      [*SMALL, f"train.run_dir={tmp_path / name}", *overrides])
    loop.train(cfg, _console(), name=name)
    return read_metrics(tmp_path / name / "metrics.jsonl")


def test_staleness_zero_gives_the_fused_runs_metrics_for_5_steps(tmp_path):
    steps = ["train.max_steps=5", "data.curriculum=pass_rate"]
    fused = _train(tmp_path, "fused", *steps)
    asynchronous = _train(tmp_path, "async", *steps, *ASYNC, "algo.max_staleness=0",
                          PHASE_TIMES)
    assert len(fused) == len(asynchronous) == 5
    for want, got in zip(fused, asynchronous, strict=True):
        assert got["async/staleness_max"] == 0 and got["async/weight_sync_bytes"] > 0
        assert got["time/weight_sync_s"] >= 0 and got["time/generate_s"] > 0
        for name, value in want.items():
            if not name.startswith(TIMING):
                np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5,
                                           err_msg=f"step {want['step']}: {name}")
    # The queue waits of both sides, from the second step on.
    assert {"time/rollout_wait_s", "time/train_wait_s"} <= set(asynchronous[1])


def test_staleness_two_trains_on_batches_two_updates_old(tmp_path):
    records = _train(tmp_path, "async", "train.max_steps=4", *ASYNC, "algo.max_staleness=2",
                     "algo.loss.tis_cap=2.0")
    assert [r["async/staleness_max"] for r in records] == [0, 1, 2, 2]
    assert all(np.isfinite(r["loss/policy"]) for r in records)
    # Importance weights of stale batches differ from 1 (the sampler had older weights).
    assert abs(records[0]["async/ratio_mean"] - 1) < 1e-5
    assert abs(records[-1]["async/ratio_mean"] - 1) > 1e-5


@pytest.mark.parametrize(("overrides", "message"), [
    (["sharding.rollout_devices=8"], "gives 8 rollout device(s) of 8"),
    (["sharding.rollout_devices=0.05"], "gives 0 rollout device(s) of 8"),
    (["sharding.rollout_layout=nope"], "nope"),
])
def test_a_split_that_leaves_a_side_without_devices_is_refused(tmp_path, overrides, message):
    cfg = load_config(ExperimentConfig, QUICKSTART, [*SMALL, f"train.run_dir={tmp_path}",
                                                     "train.max_steps=1", *ASYNC, *overrides])
    with pytest.raises((ConfigError, ValueError), match=re.escape(message)):
        loop.train(cfg, _console())


def _start(run_dir, *overrides):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    return subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "train", str(QUICKSTART),
         f"train.run_dir={run_dir}", *SMALL, *ASYNC, *overrides], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.process
def test_sigkill_then_resume_gives_the_uninterrupted_async_metrics(tmp_path):
    steps = ["train.max_steps=20", "train.checkpoint_every=4", "data.curriculum=pass_rate",
             "algo.max_staleness=2"]
    reference = _start(tmp_path / "reference", *steps)
    killed = _start(tmp_path / "killed", *steps)
    _wait_for_steps(killed, tmp_path / "killed", 10)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    written = len(read_metrics(tmp_path / "killed" / "metrics.jsonl"))
    assert 10 <= written < 20

    _, err = _finish(_start(tmp_path / "killed", *steps))
    _finish(reference)
    resumed_at = int(err.split("from the checkpoint at step ")[1].split()[0])
    assert 4 <= resumed_at <= written and resumed_at % 4 == 0
    # The two batches made ahead of the checkpoint were saved with it and trained on resume.
    assert f"2 batches made before the checkpoint (steps {resumed_at}..{resumed_at + 1})" in err
    want = read_metrics(tmp_path / "reference" / "metrics.jsonl")
    got = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(20))
    assert [r["async/staleness_max"] for r in got][:4] == [0, 1, 2, 2]
    # Bitwise: the same floats, for every step and every metric but wall-clock times.
    assert _without_timing(got) == _without_timing(want)
    assert Checkpoints(tmp_path / "killed").steps()[-1] == 20


INFLIGHT = [*ASYNC, "algo.max_staleness=2", "rollout.inflight_updates=true",
            "algo.loss.tis_cap=2.0"]


def test_inflight_updates_resume_with_a_batch_in_flight_to_the_uninterrupted_metrics(tmp_path):
    """A run stopped after step 5 checkpoints batch 5 (finished) and batch 6 (its first
    piece decoded: KV pool, slots, tokens and their versions); the resumed run decodes batch
    6's last piece and trains both as the uninterrupted run does, bit for bit."""
    want = _train(tmp_path, "reference", "train.max_steps=8", *INFLIGHT)
    _train(tmp_path, "cut", "train.max_steps=5", *INFLIGHT)
    meta = Checkpoints(tmp_path / "cut").restore_queue(5, None)[1]
    assert [(p["step"], p["made"]) for p in meta["pending"]] == [(5, True), (6, False)]
    plain = [o for o in INFLIGHT if not o.startswith("rollout.inflight")]
    with pytest.raises(RunDirError, match=re.escape(  # the batch in flight needs it
            "another experiment (rollout.inflight_updates: True -> False)")):
        _train(tmp_path, "cut", "train.max_steps=8", *plain)
    got = _train(tmp_path, "cut", "train.max_steps=8", *INFLIGHT)
    assert [r["step"] for r in got] == list(range(8))
    assert _without_timing(got) == _without_timing(want)
    assert [r["async/staleness_max"] for r in got] == [0, 1, 2, 2, 2, 2, 2, 2]
    assert all(1 < r["async/staleness_mean"] < 2 for r in got[2:])


@pytest.mark.parametrize("overrides", [
    ["rollout.inflight_updates=true"],
    ["rollout.inflight_updates=true", *ASYNC, "algo.max_staleness=1"],
])
def test_inflight_updates_need_async_with_staleness_two_or_more(overrides):
    with pytest.raises(ConfigError, match="rollout.inflight_updates=true needs "
                                          "algo.mode=async with algo.max_staleness >= 2"):
        load_config(ExperimentConfig, QUICKSTART, overrides)
    with pytest.raises(ConfigError, match="rollout.engine.min_slots=4; expected null"):
        load_config(ExperimentConfig, QUICKSTART, [*INFLIGHT, "rollout.engine.min_slots=4"])


@pytest.mark.parametrize(("value", "shown"), [("1.5", "1.5"), ("-1", "-1"), ("0", "0")])
def test_rollout_devices_must_be_a_count_or_a_fraction(value, shown):
    with pytest.raises(ConfigError, match=rf"sharding.rollout_devices must be a device count "
                                          rf".*got {re.escape(shown)}"):
        load_config(ExperimentConfig, QUICKSTART, [f"sharding.rollout_devices={value}"])
    cfg = load_config(ExperimentConfig, QUICKSTART, ["sharding.rollout_devices=3"])
    assert cfg.sharding.rollout_share == 3 and isinstance(cfg.sharding.rollout_share, int)
    cfg = load_config(ExperimentConfig, QUICKSTART, ["sharding.rollout_devices=0.25"])
    assert cfg.sharding.rollout_share == 0.25


@pytest.mark.learning
def test_staleness_two_learns_the_quickstart_task(tmp_path):
    """The shipped quickstart as it is (2-digit addition, 32 prompts x 8 samples, 16 updates
    per step), async on 4 + 4 devices with staleness 2 and truncated importance weights (cap
    2): a mean reward of 0.8 over 20 steps, within the steps measured in benchmarks/README.md
    plus a margin. Staleness 2 is the harder case (staleness 1 reached 0.8 sooner, at step 928
    against 1,176); its steps train on batches 0, 1 and 2 updates old."""
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "train", str(QUICKSTART), "eval.num_prompts=0",
         "log.plot=false", "log.tensorboard=false", "train.save_final=false",
         "perf.count_flops=false", "log.print_every=100", f"train.max_steps={LEARN_STEPS}",
         "train.checkpoint_every=0", "algo.loss.tis_cap=2.0", *ASYNC, "algo.max_staleness=2",
         f"train.run_dir={tmp_path}"], cwd=ROOT,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, _ = _finish(process, timeout=1800)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["target_reached"], (summary["reward_best"], summary["reward_last"])
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert max(r["async/staleness_max"] for r in records) == 2


@pytest.mark.process
def test_sigterm_stops_both_sides_after_a_step_with_the_queue_saved(tmp_path):
    process = _start(tmp_path, "train.max_steps=100000", "train.checkpoint_every=1000",
                     "algo.max_staleness=2")
    _wait_for_steps(process, tmp_path, 4)
    process.send_signal(signal.SIGTERM)
    out, _ = _finish(process, timeout=120)
    summary = json.loads(out.strip().splitlines()[-1])
    done = len(read_metrics(tmp_path / "metrics.jsonl"))
    assert summary["stopped_by"] == "SIGTERM" and summary["checkpoint_step"] == done
    # The two batches the rollout side had made ahead are in the checkpoint.
    meta = Checkpoints(tmp_path).restore_queue(done, None)[1]
    assert [p["step"] for p in meta["pending"]] == [done, done + 1]
    # Batch m was made at call m - 2, from the weights after m - 2 updates.
    assert [p["version"] for p in meta["pending"]] == [done - 2, done - 1]


def test_a_staleness_whose_queue_cannot_fit_is_refused_naming_it(tmp_path, capsys):
    """10^6 batches made ahead: the rollout side generated for ever (0 steps) instead of an
    error; the memory fit counts the queue (~10 KB a batch per rollout device here)."""
    from jaxrl.cli import EXIT_CONFIG_ERROR, main

    assert main(["train", str(QUICKSTART), f"train.run_dir={tmp_path / 'r'}", *SMALL, *ASYNC,
                 "algo.max_staleness=1000000", "perf.memory_limit_gib=1"]) == EXIT_CONFIG_ERROR
    err = " ".join(capsys.readouterr().err.split())
    assert "algo.max_staleness=1,000,000 keeps up to 1,000,000 batches made ahead on each " \
           "rollout device" in err, err
    fits = int(err.split("at most algo.max_staleness=")[1].split(" fits")[0].replace(",", ""))
    assert 2 <= fits < 1_000_000
    assert not (tmp_path / "r").exists()


@pytest.mark.process
def test_sigterm_while_the_queue_fills_stops_after_the_first_step(tmp_path):
    """algo.max_staleness=50,000 fits (perf.memory_limit_gib=2) but its queue takes minutes
    to fill at step 0: SIGTERM then ends the fill, and the run stops after step 0 with a
    checkpoint, as a plain run does."""
    process = _start(tmp_path / "r", "algo.max_staleness=50000", "perf.memory_limit_gib=2",
                     "train.max_steps=3")
    lines = []
    try:
        for line in process.stderr:  # the loop starts (and the fill with it) after preflight
            lines.append(line)
            if line.startswith("peak:"):
                break
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    err = "".join(lines) + err
    assert process.returncode == 0, err[-3000:]
    assert "SIGTERM: stopped after step 1 with a checkpoint" in " ".join(err.split()), err
    assert Checkpoints(tmp_path / "r").steps() == [1]
    assert [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [0]


def test_batches_in_flight_split_otherwise_are_refused_naming_both_splits():
    """A batch in flight is saved as the rollout devices' pieces: a rollout that splits its
    rows another number of ways cannot take it (here a checkpoint of an older jaxrl, one
    piece, and a rollout of 4 ways), refused before any array is read."""
    import types

    import jax
    import jax.numpy as jnp

    from jaxrl.run.async_queue import restore_queue

    steps = jax.ShapeDtypeStruct((4,), jnp.int32)  # `Partial.progress.steps`: one per device
    partial = types.SimpleNamespace(progress=types.SimpleNamespace(steps=steps))
    entries = [{"step": 6, "version": 4, "made": False, "positions": [], "data_metrics": {}}]
    with pytest.raises(ConfigError, match=re.escape(
            "checkpoint 5 holds batches in flight split 1 way(s) over the rollout devices (the "
            "rollout layout's batch axes), this run's rollout splits them 4 way(s)")):
        restore_queue(None, 5, entries, {"made": None, "partial": (partial, None, None)})
