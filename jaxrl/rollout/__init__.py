"""Rollout: the compiled KV-cache sampler and the engine interface the trainer calls."""

from jaxrl.rollout.engine import Prompts, RolloutEngine, Sampler
from jaxrl.rollout.sampler import Rollout, SamplerConfig, sample
from jaxrl.rollout.sampling import SamplingParams, process_logits, sample_tokens

__all__ = [
    "Prompts", "Rollout", "RolloutEngine", "Sampler", "SamplerConfig", "SamplingParams",
    "process_logits", "sample", "sample_tokens",
]
