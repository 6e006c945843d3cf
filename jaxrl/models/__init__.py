"""Flax NNX decoder (Llama 3.x, Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral) and HF safetensors in/out."""

from jaxrl.models.attention import PagedKV
from jaxrl.models.config import (
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    RopeScaling,
    UnsupportedModelError,
)
from jaxrl.models.hf_io import CheckpointError, from_pretrained, load_policy, save_pretrained
from jaxrl.models.load_settings import LoadSettings
from jaxrl.models.transformer import KVCache, Transformer, default_positions

__all__ = [
    "SUPPORTED_MODEL_TYPES", "CheckpointError", "KVCache", "LoadSettings", "ModelConfig", "PagedKV",
    "RopeScaling", "Transformer", "UnsupportedModelError", "default_positions", "from_pretrained",
    "load_policy", "save_pretrained",
]
