"""Golden metrics: `jaxrl train` runs (the quickstart's first 64 steps; async, multi-turn,
LoRA, MoE and GAE-critic runs of a few steps: tests/golden/runs.py) give, step by step, the
metrics recorded in tests/golden/<name>.json before issue 41's refactor of the step, the loop
and the config (but for the FLOP counts perf/model_flops, perf/xla_flops and
perf/analytic_flops, re-recorded alone when the accounting came to count the engine's
programs: each golden's "rerecorded" says so). A refactor must change no number:
re-recording (tests/golden/record.py) is for an intended change of the numbers only, stated
in its commit.

The comparison (runs.differences) holds on any x86-64 CPU, not only the goldens' own: at rel
1e-4 (abs 1e-6 for values small by cancellation), an order of magnitude above the fp32 drift
measured between the goldens' AMD EPYC (AVX2) and an Intel Xeon (AVX-512), over each run's
steps where the two CPUs' trajectories stayed comparable (all of them but the quickstart's
after its first 16 and LoRA's last); at every step, the same keys, finite values where the
golden's are, and the metrics no CPU's roundoff moves (the schedule, the data position, the
decode counts and FLOP counts). runs.py gives the measured numbers. The wall-clock metrics
(runs.EXCLUDED) are not compared, but their keys are.

What it catches (measured on the quickstart's 16 steps unless said): the GRPO advantages'
eps 1e-4 -> 2e-4 (loss/policy and grad_norm 8.7e-4 off from step 0); a 1% larger entropy
coefficient (grad_norm 5.5e-6 off at step 0, 2.1e-4 at step 10, a sampled token at 12); GAE's
lambda 1% smaller (the GAE run: value/returns_mean 1.4e-2 off at step 0). Not: the eps 1e-4
-> 1.1e-4, which moves the metrics by 8.7e-5, below the drift allowed; the fast tier's
first-steps check (tests/commands/test_train.py, rtol 1e-5 on 2 steps) catches it.

Tiers: the runs cost a few seconds each once compiled, but 10-60 s each of compiling on a
cold XLA cache (the MoE run most): more than the fast tier can take, so they are in
`process` with the quickstart prefix, which starts a `jaxrl` process. The checks of the
comparison and of the golden files run no training and are in the fast tier."""

import pytest

from tests.golden.runs import GOLDEN_DIR, HORIZON, REL, RUNS, cpu, load_golden, train
from tests.golden.runs import differences as _differences


@pytest.mark.process  # module docstring
@pytest.mark.default_compiler  # recorded as XLA compiles by default (its FLOP counts with it)
@pytest.mark.parametrize("name", list(RUNS))
def test_metrics_equal_the_golden_ones(name, tmp_path):
    golden = load_golden(name)
    config, overrides, _ = RUNS[name]
    assert golden["command"][2:] == [config, "train.run_dir=<tmp>", *overrides], \
        f"{name}: the run's overrides differ from the golden's (re-record: tests/golden/record.py)"
    problems = _differences(name, golden["steps"], train(name, tmp_path / "run"))
    recorded_on = golden["recorded_with"]["cpu"]
    other_cpu = "" if recorded_on == cpu() else (
        f" (recorded on the CPU '{recorded_on}', this one is '{cpu()}': the comparison "
        "allows the fp32 drift measured between two CPUs (tests/golden/runs.py); should only "
        "this CPU fail, measure its drift before calling it a change, docs/testing.md)")
    assert not problems, f"{len(problems)} metric(s) differ from tests/golden/{name}.json" + \
        f"{other_cpu}:\n" + "\n".join(problems[:50])


def test_a_difference_names_the_run_step_key_golden_and_got():
    want = [{"step": 0, "loss/policy": 0.5, "reward/mean": 1e-9, "time/step_s": None},
            {"step": 1, "loss/policy": 0.25, "entropy": 2.0, "time/step_s": None}]
    same = [{"step": 0, "loss/policy": 0.5 * (1 + REL / 2), "reward/mean": 5e-7,
             "time/step_s": 3.0},  # an excluded key's value is not compared
            {"step": 1, "loss/policy": 0.25, "entropy": 2.0, "time/step_s": None}]
    assert _differences("quickstart", want, same) == []
    got = [{"step": 0, "loss/policy": 0.5 * (1 + 3 * REL), "reward/mean": 1e-9,
            "time/step_s": None},
           {"step": 1, "loss/policy": 0.25, "grad_norm": 1.0, "time/step_s": None}]
    assert _differences("quickstart", want, got) == [
        f"quickstart step 0: loss/policy golden 0.5 got {0.5 * (1 + 3 * REL)!r} (rel 3.0e-04)",
        "quickstart step 1: entropy disappeared (golden 2.0)",
        "quickstart step 1: grad_norm appeared (got 1.0)"]
    assert _differences("moe", want, got[:1])[0] == "moe: 1 steps, golden 2"


def test_past_the_horizon_a_sampled_metric_may_differ_but_not_a_count_or_its_finiteness():
    horizon = HORIZON["quickstart"]
    want = [{"step": i, "lr": 1e-5 * i, "perf/xla_flops": 4.9e9, "reward/mean": 0.25,
             "loss/policy": -0.05} for i in range(horizon + 1)]

    def got(step, **values):
        return [dict(w, **values) if w["step"] == step else dict(w) for w in want]

    # Past the horizon the trajectories of two CPUs part: another sample, the same training.
    assert _differences("quickstart", want, got(horizon, **{"reward/mean": 0.5,
                                                             "loss/policy": -0.1})) == []
    assert _differences("quickstart", want, got(horizon - 1, **{"reward/mean": 0.5})) == [
        f"quickstart step {horizon - 1}: reward/mean golden 0.25 got 0.5 (rel 5.0e-01)"]
    assert _differences("quickstart", want, got(horizon, **{"perf/xla_flops": 5e9})) == [
        f"quickstart step {horizon}: perf/xla_flops golden 4900000000.0 got 5000000000.0 "
        "(rel 2.0e-02)"]
    assert _differences("quickstart", want, got(horizon, **{"loss/policy": float("nan")})) == [
        f"quickstart step {horizon}: loss/policy golden -0.05 got nan"]
    # A run without a horizon compares every metric of every step.
    assert "moe" not in HORIZON
    assert len(_differences("moe", want, got(horizon, **{"reward/mean": 0.5}))) == 1


def test_every_run_has_its_golden_recorded_with_its_overrides():
    names = sorted(p.stem for p in GOLDEN_DIR.glob("*.json"))
    assert names == sorted(RUNS)
    for name, (config, overrides, _) in RUNS.items():
        golden = load_golden(name)
        assert golden["command"][2:] == [config, "train.run_dir=<tmp>", *overrides], name
        assert golden["steps"] and all(isinstance(r, dict) for r in golden["steps"])
        assert 0 < HORIZON.get(name, len(golden["steps"])) <= len(golden["steps"]), name
