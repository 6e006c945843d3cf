"""configure_xla adds jaxrl's flags once and never overrides the user's own choice."""

import os

from jaxrl.runtime import SERIAL_CPU_COLLECTIVES_FLAG, STRICT_BF16_FLAG, configure_xla

OURS = f"{STRICT_BF16_FLAG} {SERIAL_CPU_COLLECTIVES_FLAG}"


def test_adds_the_flag_after_existing_ones(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    configure_xla()
    configure_xla()
    assert os_flags() == f"--xla_force_host_platform_device_count=8 {OURS}"


def test_keeps_a_user_setting(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=true "
                       "--xla_cpu_enable_concurrency_optimized_scheduler=true")
    configure_xla()
    assert os_flags() == ("--xla_allow_excess_precision=true "
                          "--xla_cpu_enable_concurrency_optimized_scheduler=true")


def test_sets_the_flag_when_none_are_set(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    configure_xla()
    assert os_flags() == OURS


def os_flags():
    return os.environ["XLA_FLAGS"]
