"""Test setup: 8 fake CPU devices (before jax is imported) and tiny model configs."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests (and the `jaxrl` processes some of them start, which inherit the environment)
# compile the same small programs: XLA's persistent cache compiles each once per machine.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"jaxrl-tests-xla-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

from jaxrl.runtime import configure_xla  # noqa: E402

configure_xla()  # as the jaxrl command does

import pytest  # noqa: E402

from jaxrl.models.config import tiny_config as make_tiny_config  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")


@pytest.fixture
def tiny_config():
    """Factory fixture: `tiny_config("qwen3", scan_layers=True)`."""
    return make_tiny_config
