"""The training loop in process on 8 devices: run directory contents, metrics one step late,
one compilation per program, determinism, the summary and the greedy evaluation."""

import dataclasses
import json
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ExperimentConfig, RunDirError, load_config
from jaxrl.data.tokenizer import load_tokenizer
from jaxrl.models import from_pretrained
from jaxrl.run import loop, start, summary
from jaxrl.run.metrics_log import moving_average, read_metrics
from jaxrl.saved.checkpoint import Checkpoints
from jaxrl.saved.files import MARKER_FILE
from jaxrl.step import StepOutput
from tests.test_shipped_configs import ROOT

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# The quickstart shrunk to a few seconds on the 8-device test mesh.
SMALL = ["sharding.layout=fsdp", "data.batch_size=8", "data.num_prompts=64",
         "rollout.num_generations=4", "algo.num_minibatches=2", "algo.num_iterations=1",
         "train.max_steps=3",
         "eval.num_prompts=20", "eval.batch_size=8", "log.print_every=1",
         "train.target_reward=0.0"]
# Phase stamps are host callbacks, and XLA's persistent cache stores no program holding one:
# only the runs that check the time split ask for them, so the others hit the cache.
PHASE_TIMES = "perf.phase_times=true"
# Not compared between runs: timings, and FLOPs (runs that need none skip counting them).
TIMING = ("time/step_s", "time/elapsed_s", "time/generate_s", "time/train_s",
          "perf/tokens_per_s", "perf/mfu", "perf/hfu", "perf/model_flops", "perf/xla_flops",
          "perf/analytic_flops")
NO_FLOPS = "perf.count_flops=false"  # for runs that test something else


def _config(tmp_path, *overrides):
    return load_config(ExperimentConfig, QUICKSTART,
                       [*SMALL, f"train.run_dir={tmp_path / 'run'}", *overrides])


def _console():
    from rich.console import Console

    return Console(stderr=True, width=200)


@pytest.fixture(scope="module")
def fused_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fused")
    cfg = _config(tmp, "eval.every=2", PHASE_TIMES)
    return cfg, loop.train(cfg, _console(), name="quickstart")


def test_run_dir_holds_config_metrics_tensorboard_plot_eval_and_the_init_model(fused_run):
    cfg, summary = fused_run
    run_dir = summary["run_dir"]
    assert load_config(ExperimentConfig, f"{run_dir}/config.yaml") == cfg
    records = read_metrics(f"{run_dir}/metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for name in ("reward/mean", "reward/std", "reward/addition", "completion/len_mean",
                 "completion/clipped_frac", "loss/policy", "loss/kl", "entropy", "clip_frac",
                 "grad_norm", "lr", "time/step_s", "perf/tokens_per_s",
                 "rollout/zero_std_frac"):
        assert all(np.isfinite(r[name]) for r in records), name
    events = list(Path(run_dir, "tensorboard").glob("*"))
    assert any(p.name.startswith("events.out.tfevents") for p in events)
    with open(summary["plot"], "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 100 and height > 100
    # eval.every=2: after step 2 (two steps done) and at the end (three).
    midway, evaluation = [json.loads(line) for line in open(f"{run_dir}/eval.jsonl")]
    assert midway["step"] == 2 and midway["eval/num_prompts"] == 20
    assert evaluation["step"] == cfg.train.max_steps and evaluation["eval/num_prompts"] == 20
    # The final checkpoint (train.checkpoint_every=100 > max_steps: only the one at the end).
    assert Checkpoints(run_dir).steps() == [cfg.train.max_steps]
    assert 0 <= evaluation["eval/exact_match"] <= 1
    assert evaluation["eval/pass@1"] == evaluation["eval/exact_match"]  # greedy, one sample
    assert evaluation["eval/reward_mean"] == summary["eval/reward_mean"]
    # The random policy and the trained one were saved in HF format and load back, with
    # their tokenizer; three steps of 2 updates each moved every weight.
    tokenizer = load_tokenizer(f"{run_dir}/init_model")
    initial = from_pretrained(f"{run_dir}/init_model")
    assert initial.config.vocab_size == len(tokenizer) == 16
    assert summary["final_model"] == f"{run_dir}/final_model"
    final = from_pretrained(summary["final_model"])
    assert len(load_tokenizer(summary["final_model"])) == 16
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b),
                         nnx.to_pure_dict(nnx.state(initial, nnx.Param)),
                         nnx.to_pure_dict(nnx.state(final, nnx.Param)))
    assert all(jax.tree.leaves(moved))


def test_fused_step_compiles_once_and_the_summary_adds_up(fused_run):
    cfg, summary = fused_run
    assert summary["step_compilations"] == 1  # no recompilation after the first step
    # Three steps are fewer than the moving-average window: a target is never "reached".
    assert summary["steps"] == 3 and summary["target_reached"] is False
    records = read_metrics(f"{summary['run_dir']}/metrics.jsonl")
    assert summary["reward_first"] == records[0]["reward/mean"]
    assert summary["first_step_s"] == records[0]["time/step_s"]


def test_every_step_records_flops_mfu_and_the_time_split(fused_run):
    _, summary = fused_run
    records = read_metrics(f"{summary['run_dir']}/metrics.jsonl")
    for r in records:
        assert r["perf/model_flops"] > 0 and r["perf/xla_flops"] >= 0.99 * r["perf/model_flops"]
        # Model FLOPs over the step's seconds and the 8 devices' peak, by hand.
        assert r["perf/mfu"] > 0 and r["perf/hfu"] >= 0.99 * r["perf/mfu"]
        assert r["time/generate_s"] > 0 and r["time/train_s"] > 0
        # Both phases lie inside the step: prompts in -> last update, after the last step.
        assert r["time/generate_s"] + r["time/train_s"] <= r["time/step_s"] + 1e-3
    # The analytic count is the cross-check: within 10% of XLA's on this tiny model.
    r = records[-1]
    assert 0.9 < r["perf/analytic_flops"] / r["perf/model_flops"] <= 1.0
    # A step that decoded fewer tokens did less work.
    by_steps = {r["rollout/num_steps"]: r["perf/model_flops"] for r in records}
    assert sorted(by_steps.values()) == [by_steps[k] for k in sorted(by_steps)]
    assert summary["peak_memory_bytes"] > 0
    assert summary["device_memory_bytes"] > summary["peak_memory_bytes"]
    assert 0 < summary["mfu_median"] and summary["generate_s_median"] > 0


def test_a_step_that_does_not_fit_stops_before_training_with_suggestions(tmp_path):
    from jaxrl.perf import MemoryFitError

    cfg = _config(tmp_path, "perf.memory_limit_gib=0.0001")
    with pytest.raises(MemoryFitError) as info:
        loop.train(cfg, _console())
    message = str(info.value)
    assert "step program" in message and "perf.memory_limit_gib" in message
    for suggestion in ("algo.microbatch_size=", "model.remat=block", "rollout.max_new_tokens=2"):
        assert suggestion in message
    assert not (tmp_path / "run").exists()  # nothing ran, nothing is left behind


def test_split_mode_compiles_two_programs_once_and_matches_fused_metrics(fused_run, tmp_path):
    cfg, fused = fused_run
    split = loop.train(_config(tmp_path, "algo.mode=split", NO_FLOPS), _console(), name="split")
    assert split["step_compilations"] == 2
    fused_records = read_metrics(f"{fused['run_dir']}/metrics.jsonl")
    split_records = read_metrics(f"{split['run_dir']}/metrics.jsonl")
    for f, s in zip(fused_records, split_records, strict=True):
        assert {k: v for k, v in f.items() if k not in TIMING} == \
               {k: v for k, v in s.items() if k not in TIMING}


def _metrics_without_timing(summary):
    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in read_metrics(f"{summary['run_dir']}/metrics.jsonl")]


def test_another_seed_gives_other_metrics_and_a_kl_term_runs(fused_run, tmp_path):
    _, first = fused_run
    # beta > 0 also exercises the frozen reference copy of the policy.
    other = loop.train(_config(tmp_path, "train.seed=1", "eval.num_prompts=0",
                               "algo.loss.beta=0.1", "train.save_final=false", NO_FLOPS),
                       _console())
    assert _metrics_without_timing(other) != _metrics_without_timing(first)
    records = read_metrics(f"{other['run_dir']}/metrics.jsonl")
    # k3 is never negative; once updates moved the policy off the reference it is positive.
    assert all(r["loss/kl"] >= 0 for r in records) and records[-1]["loss/kl"] > 0
    assert "final_model" not in other and not Path(other["run_dir"], "final_model").exists()


class _Spy:
    """The run's Step with `hook()` called before each step call."""

    def __init__(self, step, hook):
        self._step, self._hook = step, hook

    def __getattr__(self, name):
        return getattr(self._step, name)

    def __call__(self, *args, **kwargs):
        self._hook()
        return self._step(*args, **kwargs)


def test_metrics_already_computed_survive_a_failing_step(tmp_path, monkeypatch):
    build_run = start.build_run

    def failing_build_run(*args, **kwargs):
        run, state = build_run(*args, **kwargs)
        calls = []

        def fail_on_third():
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("simulated failure at step 2")

        return dataclasses.replace(run, step=_Spy(run.step, fail_on_third)), state

    monkeypatch.setattr(start, "build_run", failing_build_run)
    cfg = _config(tmp_path, "eval.num_prompts=0", "log.plot=false", NO_FLOPS)
    with pytest.raises(RuntimeError, match="simulated failure"):
        loop.train(cfg, _console())
    # Step 1 was dispatched before step 2 failed: its metrics are on disk too.
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1]


def test_metrics_of_a_step_are_fetched_after_the_next_step_is_dispatched(fused_run, tmp_path,
                                                                         monkeypatch):
    events = []
    build_run = start.build_run

    def spying_build_run(*args, **kwargs):
        run, state = build_run(*args, **kwargs)
        return dataclasses.replace(run, step=_Spy(run.step, lambda: events.append("dispatch"))), state

    device_get = jax.device_get

    def fetch(x):
        if isinstance(x, StepOutput):  # a step's output, not other transfers
            events.append("fetch")
        return device_get(x)

    monkeypatch.setattr(start, "build_run", spying_build_run)
    monkeypatch.setattr(jax, "device_get", fetch)
    again = loop.train(_config(tmp_path, "eval.num_prompts=0", "log.plot=false",
                               "train.save_final=false", NO_FLOPS), _console())
    assert events == ["dispatch", "dispatch", "fetch", "dispatch", "fetch", "fetch"]
    # The same config and seed as the fused run: the same metrics, step for step.
    assert _metrics_without_timing(again) == _metrics_without_timing(fused_run[1])


def test_an_existing_run_is_not_overwritten(fused_run, tmp_path):
    cfg, _ = fused_run
    # Its final checkpoint is at train.max_steps: there is nothing left to resume.
    with pytest.raises(RunDirError, match="is finished: its checkpoint is at step 3"):
        loop.train(cfg, _console())
    # A run directory with metrics but no checkpoint: nothing to resume from, and never
    # overwritten.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / MARKER_FILE).write_text("{}")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RunDirError, match="already holds a run .* no checkpoint"):
        loop.train(_config(tmp_path), _console())
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_target_is_the_first_full_window_whose_mean_reaches_it():
    w = summary.TARGET_WINDOW
    rewards = [0.0] * w + [1.0] * w  # the window mean passes 0.5 when w/2 ones are in it
    records = [{"step": i, "reward/mean": r, "time/elapsed_s": 0.1 * i}
               for i, r in enumerate(rewards)]
    hit = summary.target_reached(0.5, records)
    assert hit["target_reached"] and hit["target_step"] == w + w // 2 - 1
    assert hit["target_elapsed_s"] == pytest.approx(0.1 * (w + w // 2 - 1))
    assert summary.target_reached(1.5, records) == {"target_reward": 1.5, "target_reached": False}
    assert summary.target_reached(None, records) == {}


def test_moving_average_by_hand():
    np.testing.assert_allclose(moving_average([1, 2, 3, 4, 5], 2), [1, 1.5, 2.5, 3.5, 4.5])
    np.testing.assert_allclose(moving_average([1, 2, 3], 5), [1, 1.5, 2])


def test_ignore_eos_fills_every_completion_to_max_new_tokens(tmp_path):
    summary = loop.train(_config(tmp_path, "rollout.ignore_eos=true", "rollout.max_new_tokens=6",
                                 "train.max_steps=2", "eval.num_prompts=0", "log.plot=false",
                                 "train.save_final=false", "perf.phase_times=null"), _console())
    records = read_metrics(f"{summary['run_dir']}/metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    # By default a CPU step carries no phase stamps (they would make it synchronous); MFU
    # needs none.
    assert all("time/generate_s" not in r and r["perf/mfu"] > 0 for r in records)
    for r in records:  # a random policy samples EOS (1 in 16 tokens) but does not stop there
        assert r["completion/len_mean"] == 6 and r["completion/clipped_frac"] == 1.0
