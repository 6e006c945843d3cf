"""The phases of one RL step as plain functions: generate, score, advantages, train_on.

    rollout          = generate(sampler, policy weights, prompts, key)
    r_B, metrics     = score(rewards, reward_inputs(rollout, fields_P, rows_P))
    r_B              = shape_rewards(cfg, r_B, completion mask)     DAPO overlong penalty, if on
    adv_B, mask_BxC  = advantages(cfg, r_B, completion mask)        zero-std groups masked out
    train_on(cfg, train_state, batch, temperature):
        old_logp = stop_gradient(logp of the policy before any update)    one forward per step,
                   skipped when the step makes a single update (see below)
        for each iteration, for each minibatch:
            g = sum over microbatches of grad(policy loss of the microbatch)
            apply_gradients(g)                                            one optimizer update

The step builder (`jaxrl.step.builder`) composes them into compiled programs; every function
here is pure and traceable (train_on updates its nnx TrainState in place, nnx style).

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
import optax
from flax import nnx

from jaxrl.config.algo import AlgoSection
from jaxrl.models.lora import trainable
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
from jaxrl.rl.loss_variants import adapt_entropy_coef, applied_entropy_coef
from jaxrl.rollout import Prompts, Rollout, Sampler
from jaxrl.step import packing
from jaxrl.step.forward import (
    Batch,
    completion_log_probs,
    completion_outputs,
    completion_values,
    log_probs,
    microbatching,
    packing_metrics,
    split_rows,
    unsplit_rows,
)
from jaxrl.step.router_aux import add_router_aux, uses_router_aux
from jaxrl.step.state import TrainState
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


def _scan(f, init, xs, length=None):
    """`jax.lax.scan`, or for one step f called as it is (outputs with the scan's leading
    axis of 1): XLA keeps a one-trip loop, whose carry it copies in (the optimizer state's
    moments, weight-sized)."""
    n = length if xs is None else jax.tree.leaves(xs)[0].shape[0]
    if n != 1:
        return jax.lax.scan(f, init, xs, length=length)
    carry, ys = f(init, None if xs is None else jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], ys)


def _forward_logp(graphdef: nnx.GraphDef, states: tuple[nnx.State, ...], batch: Batch,
                  num_micro: int, temperature: float, chunk_size: int | None,
                  group: int, budgets: tuple[int, ...] = ()) -> jax.Array:
    """stop_gradient(logp_BxC) of the model `merge(graphdef, *states)`, by microbatches."""
    def one(mb):
        # A fresh copy per traced scope: nnx rejects Variables of another trace level.
        model = nnx.merge(graphdef, *states, copy=True)
        return completion_log_probs(model, mb, temperature, chunk_size, prompt_group=group,
                                    budgets=budgets)[0]

    parts = jax.lax.map(one, jax.tree.map(lambda x: split_rows(x, num_micro), batch))
    return jax.lax.stop_gradient(unsplit_rows(parts))


def entropy_coef_at(cfg: AlgoSection, update: jax.Array) -> jax.Array:
    """The entropy bonus's coefficient at optimizer update `update` (counted from 0):

        c(s) = entropy_coef · clip(1 - (s - entropy_decay_start) / entropy_decay_steps, 0, 1)

    at RL step s = update // updates_per_step (the step itself unless an update was skipped);
    c = entropy_coef throughout when entropy_decay_start is None."""
    coef = jnp.float32(cfg.loss.entropy_coef)
    if cfg.entropy_decay_start is None:
        return coef
    s = (update // cfg.updates_per_step).astype(jnp.float32)
    left = 1.0 - (s - cfg.entropy_decay_start) / cfg.entropy_decay_steps
    return coef * jnp.clip(left, 0.0, 1.0)


def microbatch_loss(cfg: AlgoSection, model: nnx.Module, mb: Batch, num_tokens: jax.Array,
                    num_seqs: jax.Array, temperature: float, *, unroll: bool = False,
                    entropy_coef: jax.Array | None = None, prompt_group: int = 1,
                    critic: Critic | None = None, packed_rows: int | None = None,
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of one microbatch, normalised by its minibatch's token and sequence
    counts (`policy_loss`); `mb` holds `train_batch`'s arrays plus ref log-probs and the old
    ones (without them, the step's only update: old = stop_gradient(new)); `entropy_coef`:
    this update's (`entropy_coef_at`), None: algo.loss.entropy_coef; `prompt_group`: see
    `completion_log_probs`; with a `critic` (algo.advantage gae: `mb` holds per-token adv_BxC,
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


def train_on(cfg: AlgoSection, ts: TrainState, batch: Batch, temperature: float, *,
             ref_params: nnx.State | None = None,
             lr_schedule: optax.Schedule | None = None, group_size: int = 1,
             ) -> dict[str, jax.Array]:
    """All optimizer updates of one step on `batch` (`train_batch`), applied to `ts` in place;
    `group_size`: consecutive rows sharing a prompt (G), for `prompt_group`. With LoRA
    only the adapters are differentiated and updated, and the KL reference is the base model
    (adapters off; `ref_params` is not used).

    Returns the metrics averaged over the updates: loss/policy, loss/kl, entropy, clip_frac
    (and tis/weight_mean, loss/router_aux with algo.router_aux_coef > 0 on an MoE policy), grad_norm (global norm before clipping), lr (when a schedule is
    given) and entropy_coef (when algo.entropy_decay_start or algo.loss.entropy_target is set:
    the adaptive coefficient after each update); and the skip counts (`TrainState.count_skips`): an update whose loss or gradient
    is not finite is not applied.
    """
    rows = batch["loss_mask_BxC"].shape[0]
    minibatch, num_micro = cfg.batch_split(rows)
    # Every microbatch, of the old/ref forwards and of the updates, is the strided slice
    # i mod total_micro of the rows (a minibatch's slices of the minibatch's slices).
    total_micro, group, budgets = microbatching(cfg, ts.model.config, group_size, batch)
    completion_len = batch["loss_mask_BxC"].shape[1]
    lora = trainable(ts.model) is nnx.LoRAParam
    if lora:
        # The KL reference is the base: the adapters' B zeroed (s · A · 0 = 0), no copy.
        model_graphdef, adapters, params, rest = nnx.split(ts.model, nnx.LoRAParam,
                                                           nnx.Param, ...)
        policy = (adapters, params, rest)
        ref_params = (jax.tree.map(jnp.zeros_like, adapters), params, rest)
    else:
        model_graphdef, params, rest = nnx.split(ts.model, nnx.Param, ...)
        policy = (params, rest)
        ref_params = None if ref_params is None else (ref_params, rest)
    batch = dict(batch)  # entries are added and removed below, never in the caller's dict
    if not cfg.single_update:
        batch["old_logp_BxC"] = _forward_logp(model_graphdef, policy, batch,
                                              total_micro, temperature,
                                              cfg.logprob_chunk_size, group, budgets)
    if cfg.loss.beta > 0:
        if ref_params is None:
            raise ValueError(f"algo.loss.beta={cfg.loss.beta} > 0 adds a KL term: pass the "
                             f"reference params (jaxrl.step.reference_params)")
        batch["ref_logp_BxC"] = _forward_logp(model_graphdef, ref_params, batch,
                                              total_micro, temperature,
                                              cfg.logprob_chunk_size, group, budgets)
    if not cfg.loss.uses_sampler_logp:
        del batch["sampler_logp_BxC"]

    def loss_fn(targets, mb, num_tokens, num_seqs, entropy_coef=None, packed_rows=None):
        model, critic = targets if isinstance(targets, tuple) else (targets, None)
        return microbatch_loss(cfg, model, mb, num_tokens, num_seqs, temperature,
                               entropy_coef=entropy_coef, prompt_group=group, critic=critic,
                               packed_rows=packed_rows)

    graphdef = nnx.graphdef(ts)
    adaptive = cfg.loss.entropy_target is not None

    def update(state, mini):
        ts = nnx.merge(graphdef, state, copy=True)
        counts_B = jnp.sum(mini["loss_mask_BxC"], axis=1)
        num_tokens, num_seqs = jnp.sum(counts_B), jnp.sum(counts_B > 0)
        wrt = ts.wrt()  # with LoRA the policy's adapters only
        params = jax.tree.map(lambda m: nnx.state(m, trainable(m)), ts.trainable(),
                              is_leaf=lambda x: isinstance(x, nnx.Module))
        entropy_coef = entropy_coef_at(cfg, ts.step)
        if adaptive:
            entropy_coef = applied_entropy_coef(ts.optimizer.entropy_coef[...],
                                                ts.optimizer.last_entropy[...], cfg.loss)

        def accumulate(carry, mb):
            def at(rows):  # the microbatch's gradient, packed into `rows` rows (None: padded)
                def grad(state):
                    targets = nnx.merge(graphdef, state, copy=True).trainable()
                    if not isinstance(targets, tuple):
                        return nnx.value_and_grad(
                            loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)(
                            targets, mb, num_tokens, num_seqs, entropy_coef, rows)
                    # (policy, critic) as two arguments, each with its own filter (`wrt`).
                    return nnx.value_and_grad(
                        lambda policy, critic, *rest: loss_fn((policy, critic), *rest),
                        argnums=(nnx.DiffState(0, wrt[0]), nnx.DiffState(1, wrt[1])),
                        has_aux=True)(*targets, mb, num_tokens, num_seqs, entropy_coef, rows)
                return grad

            if budgets:  # the smallest packed shape that holds it (`jaxrl.step.packing`)
                index = packing.branch(packing.plan_rows(mb["mask_BxT"], completion_len),
                                       budgets)
                (_, metrics), grads = jax.lax.switch(
                    index, [at(rows) for rows in (*budgets, None)], state)
            else:
                (_, metrics), grads = at(None)(state)
            return jax.tree.map(jnp.add, carry, (grads, metrics)), None

        zero_metrics = jax.eval_shape(
            lambda mb: loss_fn(nnx.merge(graphdef, state, copy=True).trainable(), mb, num_tokens,
                               num_seqs)[1],
            jax.tree.map(lambda x: x[:minibatch // num_micro], mini))
        zeros = (jax.tree.map(jnp.zeros_like, params),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_metrics))
        (grads, metrics), _ = _scan(
            accumulate, zeros, jax.tree.map(lambda x: split_rows(x, num_micro), mini))
        if isinstance(grads, tuple):  # (policy, critic): each clipped by its own optimizer
            metrics["value/grad_norm"] = optax.tree.norm(grads[1])
        metrics["grad_norm"] = optax.tree.norm(grads[0] if isinstance(grads, tuple) else grads)
        if lr_schedule is not None:
            metrics["lr"] = jnp.asarray(lr_schedule(ts.step), jnp.float32)
        if cfg.entropy_decay_start is not None:
            metrics["entropy_coef"] = entropy_coef
        # A non-finite loss or gradient skips the update: every parameter, moment and count
        # keeps its value. With one update per step, a conditional (a select fused into each
        # parameter's update reads the old moments while their own update writes them in
        # place, so XLA copies every moment first); inside the updates' loop, an elementwise
        # select of new against old, which measured faster there than the conditional.
        finite = jnp.isfinite(metrics["grad_norm"])
        for name, value in metrics.items():
            if name.startswith(("loss/", "value/loss")):
                finite &= jnp.isfinite(value)

        def apply(state, grads):
            ts = nnx.merge(graphdef, state, copy=True)
            ts.apply_gradients(grads, cfg.critic.warmup_steps * cfg.updates_per_step)
            return nnx.state(ts)

        if cfg.single_update:
            new_state = jax.lax.cond(finite, apply, lambda state, grads: state, state, grads)
        else:
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                     apply(state, grads), state)
        if adaptive:  # the controller measures every update, applied or skipped (as TRL)
            ts = nnx.merge(graphdef, new_state, copy=True)
            opt = ts.optimizer
            opt.entropy_coef[...] = adapt_entropy_coef(opt.entropy_coef[...],
                                                       metrics["entropy"], cfg.loss)
            opt.last_entropy[...] = metrics["entropy"]
            metrics["entropy_coef"] = opt.entropy_coef[...]
            new_state = nnx.state(ts)
        return new_state, (metrics, ~finite)

    def iteration(state, _):
        minibatches = jax.tree.map(lambda x: split_rows(x, cfg.num_minibatches), batch)
        return _scan(update, state, minibatches)

    state, (metrics, skipped) = _scan(iteration, nnx.state(ts), None,
                                      length=cfg.num_iterations)
    nnx.update(ts, state)
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics.update(ts.count_skips(jnp.sum(skipped, dtype=jnp.int32)))
    if budgets:
        metrics.update(packing_metrics(batch["mask_BxT"], total_micro,
                                       batch["loss_mask_BxC"].shape[1], budgets))
    return metrics


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
