"""`jaxrl generate`: sample completions from a model directory for a few prompts, text to text.

For eyeballing a policy: the tokenizer comes from the model directory, prompts go through
its chat template when it has one, and the same compiled sampler the trainer uses draws
`rollout.num_generations` completions per prompt on the mesh of `sharding.layout`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from rich.console import Console

from jaxrl.config import ModelSection, RolloutSection, ShardingSection
from jaxrl.data.tokenizer import (
    decode_completions,
    encode_prompts,
    load_tokenizer,
    pad_token_id,
    rollout_end_ids,
)
from jaxrl.models import load_policy
from jaxrl.rollout import Prompts, Sampler, SamplerConfig
from jaxrl.sharding import make_mesh, resolve_layout


@dataclasses.dataclass(frozen=True)
class GenerateSection:
    prompts: list[str] = dataclasses.field(default_factory=lambda: ["Hello!"])
    chat_template: bool = True  # render prompts with the tokenizer's chat template if it has one
    seed: int = 0

    def __post_init__(self):
        if not self.prompts:
            raise ValueError("generate.prompts is empty; give at least one prompt")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    sharding: ShardingSection = dataclasses.field(default_factory=ShardingSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    generate: GenerateSection = dataclasses.field(default_factory=GenerateSection)


def run_generate(cfg: GenerateConfig, console: Console) -> list[dict[str, Any]]:
    """Prints each prompt with its completions; returns them as records."""
    if not cfg.model.path:
        raise FileNotFoundError("generate needs a model directory: set model.path=/path/to/hf_model")
    tokenizer = load_tokenizer(cfg.model.path)
    layout = resolve_layout(cfg.sharding.layout)
    mesh = make_mesh(layout)
    # Generation only: load straight into the rollout layout.
    model = load_policy(cfg.model.path, cfg.model.load_settings(), mesh=mesh,
                        rules=layout.rollout_rules)
    graphdef, params = nnx.split(model)
    sampler_config = SamplerConfig.of(
        cfg.rollout, end_token_ids=rollout_end_ids(tokenizer, model.config, cfg.rollout),
        pad_token_id=pad_token_id(tokenizer))
    sampler = Sampler(graphdef, sampler_config, mesh=mesh, rules=layout.rollout_rules)
    ids_BxP, mask_BxP = encode_prompts(tokenizer, cfg.generate.prompts,
                                       chat_template=cfg.generate.chat_template)
    console.print(f"[bold]generate[/]: {len(cfg.generate.prompts)} prompt(s) x "
                  f"{cfg.rollout.num_generations} on mesh {dict(mesh.shape)}, "
                  f"stop ids {list(sampler_config.end_token_ids)}")
    start = time.perf_counter()
    rollout = jax.device_get(sampler.generate(params, Prompts(ids_BxP, mask_BxP),
                                              jax.random.key(cfg.generate.seed)))
    elapsed = time.perf_counter() - start
    texts = decode_completions(tokenizer, rollout.completion_ids_BxC, rollout.completion_mask_BxC)
    lengths = np.asarray(rollout.completion_mask_BxC).sum(axis=1)
    n = cfg.rollout.num_generations
    records = []
    for p, prompt in enumerate(cfg.generate.prompts):
        print(f"### prompt {p}: {prompt}", flush=True)
        for g in range(n):
            row = p * n + g
            print(f"--- completion {g} ({int(lengths[row])} tokens): {texts[row]}", flush=True)
            records.append({"prompt": prompt, "completion": texts[row],
                            "num_tokens": int(lengths[row])})
    console.print(f"{int(lengths.sum())} tokens in {elapsed:.2f}s (compile included), "
                  f"{int(rollout.num_steps)} decode steps")
    return records
