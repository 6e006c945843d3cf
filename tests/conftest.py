"""Test setup: 8 fake CPU devices (before jax is imported) and tiny model configs."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from jaxrl.models import ModelConfig, RopeScaling  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def make_tiny_config(model_type: str, **overrides) -> ModelConfig:
    """A few-thousand-parameter config exercising every switch of `model_type`."""
    fields = dict(
        model_type=model_type, vocab_size=96, hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10_000.0, max_position_embeddings=128,
    )
    if model_type == "llama":
        fields.update(rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0,
                                               original_max_position_embeddings=16),
                      rope_theta=500_000.0)
    elif model_type == "qwen2":
        fields.update(qkv_bias=True, tie_word_embeddings=True, rope_theta=1_000_000.0)
    elif model_type == "qwen3":
        fields.update(qk_norm=True, tie_word_embeddings=True, head_dim=16)
    elif model_type == "mistral":
        fields.update(sliding_window=4)
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture
def tiny_config():
    """Factory fixture: `tiny_config("qwen3", scan_layers=True)`."""
    return make_tiny_config
