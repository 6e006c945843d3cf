"""Test setup: 8 fake CPU devices (before jax is imported) and tiny model configs."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxrl.runtime import configure_xla  # noqa: E402

configure_xla()  # as the jaxrl command does

import pytest  # noqa: E402

from jaxrl.models.config import tiny_config as make_tiny_config  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture
def tiny_config():
    """Factory fixture: `tiny_config("qwen3", scan_layers=True)`."""
    return make_tiny_config
