"""The end-of-run summary's utilization: a median MFU above 1 (a peak measured low on a busy
CPU) is null with a note, never a number."""

from jaxrl.run.summary import _utilization


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
