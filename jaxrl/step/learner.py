"""The learner: one step's rollout in, the policy's updates applied, its metrics out.

    metrics, success_P, signal_P = learn(cfg, ts, rollout, inputs, host_values, ...)

    score        the task's rewards of every sample (Python ones scored on the host before,
                 `host_values`)                                        -> rewards_B
    shape        the overlong penalty (algo.overlong_*)                -> rewards_B
    advantages   by the estimator chosen once in the config: group-relative (GRPO, RLOO,
                 Dr.GRPO) per sample, or GAE per token with the critic's values
    update       the optimizer updates on the batch (`jaxrl.step.updates.apply_updates`)

It runs traced, inside whichever program the step compiles, and knows nothing of meshes or
modes: where the rollout came from is the step's business (`jaxrl.step.sources`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl.config import AlgoSection
from jaxrl.rl import RewardInputs, RewardSet, zero_std_groups
from jaxrl.rollout import Rollout
from jaxrl.rollout.types import SamplerConfig
from jaxrl.step.critic import gae_batch
from jaxrl.step.phases import advantages, completion_metrics, shape_rewards, update_batch
from jaxrl.step.state import TrainState
from jaxrl.step.updates import Metrics, apply_updates


def prompt_success(rewards: RewardSet, rewards_B: jax.Array, group_size: int) -> jax.Array:
    """success_P = the fraction of a prompt's G samples that solved it (`RewardSet.solved`).
    Partial credit does not count: a group whose samples all earn the same partial credit
    gives no learning signal either."""
    solved_B = rewards.solved(rewards_B)
    return jnp.mean(solved_B.reshape(-1, group_size), axis=1, dtype=jnp.float32)


def learn(cfg: AlgoSection, ts: TrainState, rollout: Rollout, inputs: RewardInputs,
          host_values: Any, ref_params: Any, *, rewards: RewardSet, sampler: SamplerConfig,
          lr_schedule: optax.Schedule | None) -> tuple[Metrics, jax.Array, jax.Array]:
    """(metrics, success_P, signal_P) of one step on `rollout`; `ts` is updated in place.
    signal_P is 1 where a prompt's group rewards differ (it has a group-relative advantage).
    """
    g = sampler.num_generations
    rewards_B, metrics = rewards.score(inputs, host_values)
    success_P = prompt_success(rewards, rewards_B, g)
    signal_P = 1.0 - zero_std_groups(rewards_B, g)[::g].astype(jnp.float32)
    rewards_B, shaping_metrics = shape_rewards(cfg, rewards_B, rollout.completion_mask_BxC)
    metrics.update(shaping_metrics)
    # Observation tokens of a multi-turn rollout are attended over, never trained on.
    adv_B, loss_mask_BxC, adv_metrics = advantages(cfg, rewards_B, rollout.model_token_mask(), g)
    metrics.update(adv_metrics)
    metrics.update(completion_metrics(rollout, sampler.end_token_ids))
    batch = update_batch(rollout, adv_B, loss_mask_BxC)
    if cfg.advantage == "gae":
        batch, value_metrics = gae_batch(cfg, ts, batch, g)
        metrics.update(value_metrics)
    metrics.update(apply_updates(cfg, ts, batch, sampler.sampling.temperature,
                            ref_params=ref_params, lr_schedule=lr_schedule, group_size=g))
    return metrics, success_P, signal_P
