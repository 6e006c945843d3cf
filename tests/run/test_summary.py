"""The end-of-run summary: a median MFU above 1 (a peak measured low on a busy CPU) is null
with a note, never a number; the failed reward calls of a run are summed, and absent when none
failed."""

from types import SimpleNamespace

from jaxrl.run.summary import _utilization, run_summary


def test_median_mfu_above_one_is_null_with_the_reason():
    records = [{"perf/mfu": m, "perf/hfu": m / 2} for m in (0.9, 1.05, 1.2)]
    out = _utilization(records)
    assert out["mfu_median"] is None and out["hfu_median"] == 0.525
    assert out["mfu_note"].startswith("median MFU 1.050 is above 100%")
    assert "perf.peak_tflops" in out["mfu_note"] and "hfu_note" not in out


def test_plausible_medians_are_kept_and_uncounted_ones_absent():
    assert _utilization([{"perf/mfu": 0.2, "perf/hfu": 0.3}] * 3) == {
        "mfu_median": 0.2, "hfu_median": 0.3}
    assert _utilization([{"reward/mean": 0.5}]) == {}


def _summary(records):
    """run_summary of `records` for a stand-in of a started run (only what it reads)."""
    run = SimpleNamespace(run_dir="r", step=SimpleNamespace(num_compilations=lambda: 1),
                          batches=SimpleNamespace(stats=SimpleNamespace(num_dropped=0)),
                          cfg=SimpleNamespace(train=SimpleNamespace(target_reward=None)))
    pre = SimpleNamespace(memory=SimpleNamespace(programs=[], peak_bytes=0, limit_bytes=0))
    started = SimpleNamespace(run=run, pre=pre, setup_s=1.0)
    return run_summary(started, [{"step": i, "reward/mean": 0.0, "time/step_s": 0.1,
                                  "perf/tokens_per_s": 10.0, **r}
                                 for i, r in enumerate(records)], 1.0)


def test_the_failed_reward_calls_of_a_run_are_summed_and_absent_when_none_failed():
    """A run allowed to fail its rewards (train.reward_error_frac=1: tests/run/test_guards.py)
    goes on; its summary counts every failed call."""
    summary = _summary([{"reward/errors": 16.0}] * 3)
    assert summary["steps"] == 3 and summary["reward_errors"] == 3 * 16
    assert "reward_errors" not in _summary([{"reward/errors": 0.0}] * 3)
