"""The phases of one RL step between the rollout and the updates, as plain functions.

    inputs           = reward_inputs(rollout, fields_P, rows_P, G)  what the rewards read
    r_B, metrics     = RewardSet.score(inputs)                      (`jaxrl.rl.rewards`)
    r_B              = shape_rewards(cfg, r_B, completion mask)     DAPO overlong penalty, if on
    adv_B, mask_BxC  = advantages(cfg, r_B, completion mask)        zero-std groups masked out
    batch            = update_batch(rollout, adv_B, mask_BxC)       what the updates read

The learner (`jaxrl.step.learner`) calls them in that order, then the updates
(`jaxrl.step.updates.apply_updates`); every function here is pure and traceable.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.config.algo import AlgoSection
from jaxrl.rl import (
    RewardInputs,
    dr_grpo_advantages,
    grpo_advantages,
    overlong_penalty,
    rloo_advantages,
    zero_std_frac,
    zero_std_groups,
)
from jaxrl.rollout import Rollout
from jaxrl.step.forward import (
    UpdateBatch,
)


def reward_inputs(rollout: Rollout, fields_P: dict[str, jax.Array], rows_P: jax.Array,
                  group_size: int) -> RewardInputs:
    """The rollout's rows with each prompt's task fields and dataset row repeated G times."""
    def repeat(x):
        return jnp.repeat(jnp.asarray(x), group_size, axis=0)

    return RewardInputs(
        prompt_ids_BxP=rollout.prompt_ids_BxP, prompt_mask_BxP=rollout.prompt_mask_BxP,
        completion_ids_BxC=rollout.completion_ids_BxC,
        completion_mask_BxC=rollout.completion_mask_BxC,
        fields={k: repeat(v) for k, v in fields_P.items()}, rows_B=repeat(rows_P))


def shape_rewards(cfg: AlgoSection, rewards_B: jax.Array, completion_mask_BxC: jax.Array,
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """rewards_B + DAPO's overlong penalty (`overlong_penalty`, soft zone = the last
    `cfg.overlong_buffer` tokens of the completion budget C) when it is on."""
    if cfg.overlong_buffer is None:
        return rewards_B, {}
    budget = completion_mask_BxC.shape[1]
    lengths_B = jnp.sum(completion_mask_BxC.astype(jnp.int32), axis=1)
    penalty_B = overlong_penalty(lengths_B, budget, cfg.overlong_buffer)
    return rewards_B + penalty_B, {"reward/overlong": jnp.mean(penalty_B)}


def advantages(cfg: AlgoSection, rewards_B: jax.Array, mask_BxC: jax.Array, group_size: int,
               ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(adv_B, loss mask_BxC, metrics): the configured estimator, zero-std groups masked."""
    if cfg.advantage == "grpo":
        adv_B = grpo_advantages(rewards_B, group_size, cfg.scale_rewards)
    elif cfg.advantage == "rloo":
        adv_B = rloo_advantages(rewards_B, group_size)
    elif cfg.advantage == "dr_grpo":
        adv_B = dr_grpo_advantages(rewards_B, group_size)
    else:  # gae: the sequence rewards, made per-token advantages by `jaxrl.step.critic`
        adv_B = rewards_B.astype(jnp.float32)
    mask_BxC = mask_BxC.astype(bool)
    if cfg.mask_zero_std_groups:
        mask_BxC = mask_BxC & ~zero_std_groups(rewards_B, group_size)[:, None]
    return adv_B, mask_BxC, {"rollout/zero_std_frac": zero_std_frac(rewards_B, group_size)}


def update_batch(rollout: Rollout, adv_B: jax.Array, loss_mask_BxC: jax.Array
                 ) -> UpdateBatch:
    """The arrays `apply_updates` reads, one row per sample: prompt ⊕ completion and its mask."""
    return {
        "ids_BxT": jnp.concatenate([rollout.prompt_ids_BxP, rollout.completion_ids_BxC], 1),
        "mask_BxT": jnp.concatenate([rollout.prompt_mask_BxP.astype(bool),
                                     rollout.completion_mask_BxC.astype(bool)], 1),
        "loss_mask_BxC": loss_mask_BxC, "adv_B": adv_B, "sampler_logp_BxC": rollout.logp_raw_BxC,
    }


def completion_metrics(rollout: Rollout, end_token_ids: tuple[int, ...],
                       ) -> dict[str, Any]:
    """completion/len_mean, completion/clipped_frac (no stop token within the budget),
    rollout/num_steps (filled completion columns) and rollout/decode_slot_steps (one-row
    forward passes the decode loop ran: what its FLOPs scale with)."""
    mask_BxC = rollout.completion_mask_BxC.astype(bool)
    stop_ids = jnp.asarray(end_token_ids or (-1,), jnp.int32)
    stopped_B = jnp.any(mask_BxC & jnp.isin(rollout.completion_ids_BxC, stop_ids), axis=1)
    return {
        "completion/len_mean": jnp.mean(jnp.sum(mask_BxC, axis=1), dtype=jnp.float32),
        "completion/clipped_frac": jnp.mean(mask_BxC[:, -1] & ~stopped_B, dtype=jnp.float32),
        "rollout/num_steps": rollout.num_steps,
        "rollout/decode_slot_steps": rollout.decode_slot_steps,
    }
