"""Golden metrics: `jaxrl train` runs (the quickstart's first 64 steps and its whole run;
async, multi-turn, LoRA, MoE and GAE-critic runs of a few steps: tests/golden/runs.py) give,
step by step, the metrics recorded in tests/golden/<name>.json before issue 41's refactor of
the step, the loop and the config (but for the FLOP counts perf/model_flops, perf/xla_flops
and perf/analytic_flops, re-recorded alone when the accounting came to count the engine's
programs: each golden's "rerecorded" says so). A refactor must change no number: re-recording
(tests/golden/record.py) is for an intended change of the numbers only, stated in its commit.

Every metric of every step is compared, with rel 1e-6, and abs 1e-6 for values near zero
(a loss or an advantage mean of ~1e-9 has no meaningful relative error); the metrics of
wall-clock time (runs.EXCLUDED) are not, but their keys are: a metric that appears or
disappears fails too. The numbers are those of this machine's CPU kernels (jaxlib and CPU in
the golden's "recorded_with"); another CPU may round fp32 differently.

Tiers: the in-process runs cost a few seconds each once compiled, but 10-60 s each of
compiling on a cold XLA cache (the MoE run most): more than the fast tier can take, so they
are in `process` with the quickstart prefix, which starts a `jaxrl` process. The whole
quickstart (3,000 steps, minutes) is in `learning`, with the other long runs. The checks of
the comparison and of the golden files run no training and are in the fast tier."""

import pytest

from tests.golden.runs import GOLDEN_DIR, LONG, RUNS, cpu, load_golden, train
from tests.golden.runs import differences as _differences


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.learning if name in LONG else pytest.mark.process)
    for name in RUNS])  # module docstring
def test_metrics_equal_the_golden_ones(name, tmp_path):
    golden = load_golden(name)
    config, overrides, _ = RUNS[name]
    assert golden["command"][2:] == [config, "train.run_dir=<tmp>", *overrides], \
        f"{name}: the run's overrides differ from the golden's (re-record: tests/golden/record.py)"
    problems = _differences(name, golden["steps"], train(name, tmp_path / "run"))
    recorded_on = golden["recorded_with"]["cpu"]
    other_cpu = "" if recorded_on == cpu() else (
        f" (recorded on the CPU '{recorded_on}', this one is '{cpu()}': fp32 may round "
        "differently there; re-record at the pre-refactor commit on this CPU, README 'Tests')")
    assert not problems, f"{len(problems)} metric(s) differ from tests/golden/{name}.json" + \
        f"{other_cpu}:\n" + "\n".join(problems[:50])


def test_a_difference_names_the_run_step_key_golden_and_got():
    want = [{"step": 0, "loss/policy": 0.5, "reward/mean": 1e-9, "time/step_s": None},
            {"step": 1, "loss/policy": 0.25, "entropy": 2.0, "time/step_s": None}]
    same = [{"step": 0, "loss/policy": 0.5 * (1 + 5e-7), "reward/mean": 5e-7,
             "time/step_s": None},
            {"step": 1, "loss/policy": 0.25, "entropy": 2.0, "time/step_s": None}]
    assert _differences("quickstart", want, same) == []
    got = [{"step": 0, "loss/policy": 0.5 * (1 + 3e-6), "reward/mean": 1e-9,
            "time/step_s": None},
           {"step": 1, "loss/policy": 0.25, "grad_norm": 1.0, "time/step_s": None}]
    assert _differences("quickstart", want, got) == [
        f"quickstart step 0: loss/policy golden 0.5 got {0.5 * (1 + 3e-6)!r}",
        "quickstart step 1: entropy disappeared (golden 2.0)",
        "quickstart step 1: grad_norm appeared (got 1.0)"]
    assert _differences("moe", want, got[:1])[0] == "moe: 1 steps, golden 2"


def test_every_run_has_its_golden_recorded_with_its_overrides():
    names = sorted(p.stem for p in GOLDEN_DIR.glob("*.json"))
    assert names == sorted(RUNS)
    for name, (config, overrides, _) in RUNS.items():
        golden = load_golden(name)
        assert golden["command"][2:] == [config, "train.run_dir=<tmp>", *overrides], name
        assert golden["steps"] and all(isinstance(r, dict) for r in golden["steps"])
