"""configure_xla adds jaxrl's flag once and never overrides the user's own choice."""

import os

from jaxrl.runtime import STRICT_BF16_FLAG, configure_xla


def test_adds_the_flag_after_existing_ones(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    configure_xla()
    configure_xla()
    assert os_flags() == f"--xla_force_host_platform_device_count=8 {STRICT_BF16_FLAG}"


def test_keeps_a_user_setting(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=true")
    configure_xla()
    assert os_flags() == "--xla_allow_excess_precision=true"


def test_sets_the_flag_when_none_are_set(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    configure_xla()
    assert os_flags() == STRICT_BF16_FLAG


def os_flags():
    return os.environ["XLA_FLAGS"]
