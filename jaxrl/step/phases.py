"""The phases of one RL step as plain functions: generate, score, advantages, the loss.

    rollout          = generate(sampler, policy weights, prompts, key)
    r_B, metrics     = score(rewards, reward_inputs(rollout, fields_P, rows_P))
    r_B              = shape_rewards(cfg, r_B, completion mask)     DAPO overlong penalty, if on
    adv_B, mask_BxC  = advantages(cfg, r_B, completion mask)        zero-std groups masked out
    batch            = train_batch(rollout, adv_B, mask_BxC)
    loss, metrics    = microbatch_loss(cfg, model, microbatch, ...)  of one microbatch

The learner (`jaxrl.step.learner`) calls them in that order and the updates
(`jaxrl.step.updates.train_on`) sum `microbatch_loss`'s gradients; every function here is
pure and traceable.

Deliberate choices:
- Microbatch losses are normalised by the counts of their whole minibatch (valid tokens,
  non-empty sequences; `policy_loss`'s num_tokens / num_seqs), so the summed gradients of the
  microbatches are the minibatch's gradient, whatever the aggregation: accumulation ≡ full
  batch up to float rounding, and the loss metrics sum the same way.
- Minibatches and microbatches are *strided* row sets (minibatch m of M holds rows
  m, m + M, m + 2M, ...): on a mesh every slice then stays evenly split over the devices
  that hold the batch rows, so slicing moves no data. A minibatch thus mixes groups;
  advantages are computed over the whole batch before, so nothing depends on that.
- old_logp is recomputed by the trainer's forward instead of reusing the sampler's: the
  ratio of the first update is then exactly 1, and the sampler's own log-probs (at
  temperature 1, `logp_raw_BxC`) serve only TIS, which corrects the sampler/trainer gap.
- When a step makes one update (num_iterations x num_minibatches == 1) the policy that
  computes the loss *is* the old policy, so old_logp = stop_gradient(logp) of the same
  forward: one forward pass per step less, the same loss and gradient (the ratio is exactly
  1 either way).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config.algo import AlgoSection
from jaxrl.rl import (
    RewardInputs,
    RewardSet,
    dr_grpo_advantages,
    grpo_advantages,
    overlong_penalty,
    policy_loss,
    rloo_advantages,
    zero_std_frac,
    zero_std_groups,
)
from jaxrl.rl.gae import value_loss
from jaxrl.rollout import Prompts, Rollout, Sampler
from jaxrl.step.forward import (
    Batch,
    completion_outputs,
    completion_values,
    log_probs,
)
from jaxrl.step.router_aux import add_router_aux, uses_router_aux
from jaxrl.step.value_model import Critic


def generate(sampler: Sampler, params: nnx.State, prompts: Prompts, key: jax.Array) -> Rollout:
    """G completions per prompt from the policy whose weights are `params` (traceable)."""
    return sampler.generate_traced(params, prompts, key)


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


def score(rewards: RewardSet, inputs: RewardInputs,
          host_values: tuple[jax.Array, jax.Array] | None = None,
          ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(reward_B, reward metrics); Python rewards by callback unless `host_values` are given."""
    return rewards.score(inputs, host_values)


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


def train_batch(rollout: Rollout, adv_B: jax.Array, loss_mask_BxC: jax.Array) -> Batch:
    """The arrays `train_on` reads, one row per sample: prompt ⊕ completion and its mask."""
    return {
        "ids_BxT": jnp.concatenate([rollout.prompt_ids_BxP, rollout.completion_ids_BxC], 1),
        "mask_BxT": jnp.concatenate([rollout.prompt_mask_BxP.astype(bool),
                                     rollout.completion_mask_BxC.astype(bool)], 1),
        "loss_mask_BxC": loss_mask_BxC, "adv_B": adv_B, "sampler_logp_BxC": rollout.logp_raw_BxC,
    }


def microbatch_loss(cfg: AlgoSection, model: nnx.Module, mb: Batch, num_tokens: jax.Array,
                    num_seqs: jax.Array, temperature: float, *, unroll: bool = False,
                    entropy_coef: jax.Array | None = None, prompt_group: int = 1,
                    critic: Critic | None = None, packed_rows: int | None = None,
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of one microbatch, normalised by its minibatch's token and sequence
    counts (`policy_loss`); `mb` holds `train_batch`'s arrays plus ref log-probs and the old
    ones (without them, the step's only update: old = stop_gradient(new)); `entropy_coef`:
    this update's (`jaxrl.step.updates.entropy_coef_at`), None: algo.loss.entropy_coef;
    `prompt_group`: see `completion_log_probs`; with a `critic` (algo.advantage gae: `mb` holds per-token adv_BxC,
    returns_BxC and old_values_BxC) + vf_coef x the clipped value loss (`jaxrl.rl.gae`); for
    a mixture of experts with algo.router_aux_coef > 0, + that x the load-balancing loss;
    `packed_rows`: run packed into that many rows (`jaxrl.step.packing`), None: padded."""
    aux = uses_router_aux(cfg.router_aux_coef, model.config)
    head = critic is not None and critic.trunk is None  # a value head on the policy's trunk

    def per_token(mods, hidden, targets):
        logp, entropy = log_probs(mods[0], hidden, targets, temperature,
                                  cfg.logprob_chunk_size, unroll=unroll)
        return (logp, entropy, mods[1].head(hidden)) if head else (logp, entropy)

    out, *stats = completion_outputs((model, critic) if head else (model,), mb, per_token,
                                     prompt_group=prompt_group, packed_rows=packed_rows,
                                     router_stats=aux)
    logp_BxC, entropy_BxC = out[:2]
    old_logp_BxC = mb.get("old_logp_BxC")
    if old_logp_BxC is None:  # one update per step: this forward is the old policy's
        old_logp_BxC = jax.lax.stop_gradient(logp_BxC)
    loss, metrics = policy_loss(
        logp_BxC, old_logp_BxC, mb["adv_BxC"] if critic is not None else mb["adv_B"],
        mb["loss_mask_BxC"], cfg.loss,
        ref_logp_BxT=mb.get("ref_logp_BxC"), sampler_logp_BxT=mb.get("sampler_logp_BxC"),
        entropy_BxT=entropy_BxC, max_completion_len=mb["loss_mask_BxC"].shape[1],
        num_tokens=num_tokens, num_seqs=num_seqs, entropy_coef=entropy_coef)
    if aux:  # + algo.router_aux_coef x the load-balancing loss (jaxrl.step.router_aux)
        loss, metrics = add_router_aux(cfg.router_aux_coef, model.config, stats[0], mb,
                                       num_tokens, loss, metrics)
    if critic is None:
        return loss, metrics
    values_BxC = out[2] if head else completion_values(critic, mb, model, prompt_group,
                                                       packed_rows=packed_rows)
    v_loss, v_metrics = value_loss(
        values_BxC, mb["old_values_BxC"], mb["returns_BxC"], mb["loss_mask_BxC"],
        cfg.critic.value_clip, cfg.loss.aggregation, num_tokens=num_tokens, num_seqs=num_seqs,
        max_completion_len=mb["loss_mask_BxC"].shape[1])
    return loss + cfg.critic.vf_coef * v_loss, metrics | v_metrics


def completion_metrics(rollout: Rollout, stop_token_ids: tuple[int, ...],
                       ) -> dict[str, Any]:
    """completion/len_mean, completion/clipped_frac (no stop token within the budget),
    rollout/num_steps (filled completion columns) and rollout/decode_slot_steps (one-row
    forward passes the decode loop ran: what its FLOPs scale with)."""
    mask_BxC = rollout.completion_mask_BxC.astype(bool)
    stop_ids = jnp.asarray(stop_token_ids or (-1,), jnp.int32)
    stopped_B = jnp.any(mask_BxC & jnp.isin(rollout.completion_ids_BxC, stop_ids), axis=1)
    return {
        "completion/len_mean": jnp.mean(jnp.sum(mask_BxC, axis=1), dtype=jnp.float32),
        "completion/clipped_frac": jnp.mean(mask_BxC[:, -1] & ~stopped_B, dtype=jnp.float32),
        "rollout/num_steps": rollout.num_steps,
        "rollout/decode_slot_steps": rollout.decode_slot_steps,
    }
