"""Rollout: the slot engine (`slots`), its drivers, and the interface the trainer calls."""

from jaxrl.rollout.dense_reference import sample_dense
from jaxrl.rollout.engine import Prompts, RolloutEngine, Sampler
from jaxrl.rollout.sampling import SamplingParams, process_logits, sample_tokens
from jaxrl.rollout.types import Rollout, SamplerConfig

__all__ = [
    "Prompts", "Rollout", "RolloutEngine", "Sampler", "SamplerConfig", "SamplingParams",
    "process_logits", "sample_dense", "sample_tokens",
]
