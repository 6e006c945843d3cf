"""Utilization against values worked out by hand, and FLOP formatting."""

import math

import pytest

from jaxrl.perf.mfu import format_flops, utilization


def test_utilization_by_hand():
    # 8 H100s (989 TFLOP/s) for 2 s can do 15.824e15 FLOP; a step of 3.9560e15 is a quarter.
    assert utilization(3.956e15, 2.0, 8, 989e12) == pytest.approx(0.25)
    # one CPU device at 1 GFLOP/s, 0.5 s step, 1e8 FLOP -> 0.2
    assert utilization(1e8, 0.5, 1, 1e9) == pytest.approx(0.2)
    assert utilization(0.0, 1.0, 1, 1e9) == 0.0


@pytest.mark.parametrize("args, message", [
    ((1e9, 0.0, 8, 1e12), "step_s must be > 0 seconds, got 0.0"),
    ((1e9, -1.0, 8, 1e12), "step_s must be > 0 seconds, got -1.0"),
    ((1e9, math.nan, 8, 1e12), "step_s must be > 0 seconds, got nan"),
    ((1e9, 1.0, 0, 1e12), "num_devices must be > 0, got 0"),
    ((1e9, 1.0, 8, 0.0), "peak_flops_per_device must be > 0 FLOP/s, got 0.0"),
    ((-1.0, 1.0, 8, 1e12), "flops_per_step must be >= 0, got -1.0"),
])
def test_utilization_rejects_bad_values(args, message):
    with pytest.raises(ValueError) as info:
        utilization(*args)
    assert str(info.value) == message


@pytest.mark.parametrize("flops, text", [
    (1.234e12, "1.23 TFLOP"), (5e8, "500.00 MFLOP"), (2.5e15, "2.50 PFLOP"), (999.0, "999.00 FLOP"),
    (0.0, "0.00 FLOP"), (None, "n/a (cost analysis unavailable)"),
    (-1.0, "n/a (cost analysis unavailable)"),
])
def test_format_flops(flops, text):
    assert format_flops(flops) == text


def test_an_impossible_utilization_is_not_a_number():
    from jaxrl.perf.mfu import plausible

    assert plausible(0.24) == 0.24 and plausible(1.0) == 1.0
    assert plausible(1.011) is None and plausible(None) is None
