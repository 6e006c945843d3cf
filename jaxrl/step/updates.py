"""The optimizer updates of one step: `apply_updates(cfg, ts, batch, temperature)`.

    old_logp = stop_gradient(logp of the policy before any update)    one forward per step,
               skipped when the step makes a single update (its own forward is the old one)
    ref_logp = stop_gradient(logp of the KL reference)                 when algo.loss.beta > 0
    for each iteration, for each minibatch:                            one optimizer update
        g = sum over microbatches of grad(loss of the microbatch)      (`microbatch_loss`)
        apply g if the loss and g are finite, else keep every parameter and moment

What is trained is the train state's trainable-parameter filter (`TrainState.trainable`,
`TrainState.wrt`): the policy's parameters, its LoRA adapters only, or the policy and a
separate critic (each clipped and stepped by its own optimizer). The KL reference follows
the same filter (`policy_and_reference`). The adaptive entropy coefficient
(algo.loss.entropy_target) is a hook after each update (`adapt_entropy`).

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

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl.config.algo import AlgoSection
from jaxrl.models.lora import trainable
from jaxrl.rl import policy_loss
from jaxrl.rl.gae import value_loss
from jaxrl.rl.loss_variants import adapt_entropy_coef, applied_entropy_coef
from jaxrl.step import packing
from jaxrl.step.forward import (
    UpdateBatch,
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

Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class UpdateShapes:
    """What every update of a step shares: the static shapes and settings (`apply_updates`)."""

    cfg: AlgoSection
    graphdef: nnx.GraphDef  # of the TrainState
    temperature: float
    group: int  # consecutive rows sharing a prompt (`prompt_group`)
    budgets: tuple[int, ...]  # packed row counts (`jaxrl.step.packing`); () padded
    minibatch: int  # rows of a minibatch
    num_micro: int  # microbatches of a minibatch
    completion_len: int
    lr_schedule: optax.Schedule | None


def apply_updates(cfg: AlgoSection, ts: TrainState, batch: UpdateBatch, temperature: float, *,
             ref_params: nnx.State | None = None,
             lr_schedule: optax.Schedule | None = None, group_size: int = 1,
             ) -> dict[str, jax.Array]:
    """All optimizer updates of one step on `batch` (`update_batch`), applied to `ts` in place;
    `group_size`: consecutive rows sharing a prompt (G), for `prompt_group`. With LoRA
    only the adapters are differentiated and updated, and the KL reference is the base model
    (adapters off; `ref_params` is not used).

    Returns the metrics averaged over the updates: loss/policy, loss/kl, entropy, clip_frac
    (and tis/weight_mean, loss/router_aux with algo.router_aux_coef > 0 on an MoE policy),
    grad_norm (global norm before clipping), lr (when a schedule is given) and entropy_coef
    (when algo.entropy_decay_start or algo.loss.entropy_target is set: the adaptive
    coefficient after each update); and the skip counts (`TrainState.count_skips`): an update
    whose loss or gradient is not finite is not applied.
    """
    minibatch, num_micro = cfg.batch_split(batch["loss_mask_BxC"].shape[0])
    # Every microbatch, of the old/ref forwards and of the updates, is the strided slice
    # i mod total_micro of the rows (a minibatch's slices of the minibatch's slices).
    total_micro, group, budgets = microbatching(cfg, ts.model.config, group_size, batch)
    shapes = UpdateShapes(cfg, nnx.graphdef(ts), temperature, group, budgets, minibatch, num_micro,
                batch["loss_mask_BxC"].shape[1], lr_schedule)
    batch = with_old_and_ref_logp(shapes, ts.model, batch, ref_params, total_micro)

    def iteration(state, _):
        minibatches = jax.tree.map(lambda x: split_rows(x, cfg.num_minibatches), batch)
        return _scan(functools.partial(update, shapes), state, minibatches)

    state, (metrics, skipped) = _scan(iteration, nnx.state(ts), None,
                                      length=cfg.num_iterations)
    nnx.update(ts, state)
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics.update(ts.count_skips(jnp.sum(skipped, dtype=jnp.int32)))
    if budgets:
        metrics.update(packing_metrics(batch["mask_BxT"], total_micro,
                                       batch["loss_mask_BxC"].shape[1], budgets))
    return metrics


def policy_and_reference(model: nnx.Module, ref_params: nnx.State | None
                         ) -> tuple[nnx.GraphDef, tuple[nnx.State, ...], tuple | None]:
    """(graphdef, the policy's states, the KL reference's states or None), split by the
    model's trainable filter. With LoRA adapters the reference is the base model: the
    adapters zeroed (s · A · 0 = 0), no copy of the weights."""
    if trainable(model) is nnx.LoRAParam:
        graphdef, adapters, params, rest = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
        return graphdef, (adapters, params, rest), (
            jax.tree.map(jnp.zeros_like, adapters), params, rest)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, (params, rest), None if ref_params is None else (ref_params, rest)


def microbatch_loss(cfg: AlgoSection, model: nnx.Module, mb: UpdateBatch, num_tokens: jax.Array,
                    num_seqs: jax.Array, temperature: float, *, unroll: bool = False,
                    entropy_coef: jax.Array | None = None, prompt_group: int = 1,
                    critic: Critic | None = None, packed_rows: int | None = None,
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of one microbatch, normalised by its minibatch's token and sequence
    counts (`policy_loss`); `mb` holds `update_batch`'s arrays plus ref log-probs and the old
    ones (without them, the step's only update: old = stop_gradient(new)); `entropy_coef`:
    this update's (`jaxrl.step.updates.entropy_coef_at`), None: algo.loss.entropy_coef;
    `prompt_group`: see `completion_log_probs`; with a `critic` (algo.advantage gae: `mb`
    holds per-token adv_BxC,
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


def with_old_and_ref_logp(shapes: UpdateShapes, model: nnx.Module, batch: UpdateBatch,
                          ref_params: nnx.State | None, total_micro: int) -> UpdateBatch:
    """`batch` (a copy) with old_logp_BxC (several updates per step) and ref_logp_BxC
    (algo.loss.beta > 0), and without the sampler's log-probs where the loss does not read
    them."""
    cfg = shapes.cfg
    graphdef, policy, reference = policy_and_reference(model, ref_params)
    batch = dict(batch)  # entries are added and removed below, never in the caller's dict
    if not cfg.single_update:
        batch["old_logp_BxC"] = forward_logp(shapes, graphdef, policy, batch, total_micro)
    if cfg.loss.beta > 0:
        if reference is None:
            raise ValueError(f"algo.loss.beta={cfg.loss.beta} > 0 adds a KL term: pass the "
                             f"reference params (jaxrl.step.reference_params)")
        batch["ref_logp_BxC"] = forward_logp(shapes, graphdef, reference, batch, total_micro)
    if not cfg.loss.uses_sampler_logp:
        del batch["sampler_logp_BxC"]
    return batch


def forward_logp(shapes: UpdateShapes, graphdef: nnx.GraphDef, states: tuple[nnx.State, ...],
                 batch: UpdateBatch, num_micro: int) -> jax.Array:
    """stop_gradient(logp_BxC) of the model `merge(graphdef, *states)`, by microbatches."""
    def one(mb):
        # A fresh copy per traced scope: nnx rejects Variables of another trace level.
        model = nnx.merge(graphdef, *states, copy=True)
        return completion_log_probs(model, mb, shapes.temperature, shapes.cfg.logprob_chunk_size,
                                    prompt_group=shapes.group, budgets=shapes.budgets)[0]

    parts = jax.lax.map(one, jax.tree.map(lambda x: split_rows(x, num_micro), batch))
    return jax.lax.stop_gradient(unsplit_rows(parts))


def update(shapes: UpdateShapes, state: nnx.State, mini: UpdateBatch
           ) -> tuple[nnx.State, tuple[Metrics, Any]]:
    """One optimizer update on minibatch `mini`: (new state, (metrics, skipped))."""
    cfg = shapes.cfg
    ts = nnx.merge(shapes.graphdef, state, copy=True)
    counts_B = jnp.sum(mini["loss_mask_BxC"], axis=1)
    num_tokens, num_seqs = jnp.sum(counts_B), jnp.sum(counts_B > 0)
    entropy_coef = entropy_coef_at(cfg, ts.step)
    if cfg.loss.entropy_target is not None:
        entropy_coef = applied_entropy_coef(ts.optimizer.entropy_coef[...],
                                            ts.optimizer.last_entropy[...], cfg.loss)
    grads, metrics = gradients(shapes, state, ts, mini, num_tokens, num_seqs, entropy_coef)
    if isinstance(grads, tuple):  # (policy, critic): each clipped by its own optimizer
        metrics["value/grad_norm"] = optax.tree.norm(grads[1])
    metrics["grad_norm"] = optax.tree.norm(grads[0] if isinstance(grads, tuple) else grads)
    if shapes.lr_schedule is not None:
        metrics["lr"] = jnp.asarray(shapes.lr_schedule(ts.step), jnp.float32)
    if cfg.entropy_decay_start is not None:
        metrics["entropy_coef"] = entropy_coef
    finite = jnp.isfinite(metrics["grad_norm"])
    for name, value in metrics.items():
        if name.startswith(("loss/", "value/loss")):
            finite &= jnp.isfinite(value)
    new_state = apply_if_finite(shapes, state, grads, finite)
    if cfg.loss.entropy_target is not None:
        new_state, metrics["entropy_coef"] = adapt_entropy(shapes, new_state, metrics["entropy"])
    return new_state, (metrics, ~finite)


def gradients(shapes: UpdateShapes, state: nnx.State, ts: TrainState, mini: UpdateBatch,
              num_tokens: jax.Array,
              num_seqs: jax.Array, entropy_coef: jax.Array) -> tuple[Any, Metrics]:
    """(grads, metrics) of minibatch `mini`, summed over its microbatches; grads has the
    trainable filter's structure (`TrainState.trainable`)."""
    wrt = ts.wrt()  # with LoRA the policy's adapters only

    def loss_fn(targets, mb, num_tokens, num_seqs, entropy_coef=None, packed_rows=None):
        model, critic = targets if isinstance(targets, tuple) else (targets, None)
        return microbatch_loss(shapes.cfg, model, mb, num_tokens, num_seqs, shapes.temperature,
                               entropy_coef=entropy_coef, prompt_group=shapes.group,
                               critic=critic, packed_rows=packed_rows)

    def accumulate(carry, mb):
        def at(rows):  # the microbatch's gradient, packed into `rows` rows (None: padded)
            def grad(state):
                targets = nnx.merge(shapes.graphdef, state, copy=True).trainable()
                return value_and_grad(loss_fn, targets, wrt)(
                    mb, num_tokens, num_seqs, entropy_coef, rows)
            return grad

        if shapes.budgets:  # the smallest packed shape that holds it (`jaxrl.step.packing`)
            index = packing.branch(packing.plan_rows(mb["mask_BxT"], shapes.completion_len),
                                   shapes.budgets)
            (_, metrics), grads = jax.lax.switch(
                index, [at(rows) for rows in (*shapes.budgets, None)], state)
        else:
            (_, metrics), grads = at(None)(state)
        return jax.tree.map(jnp.add, carry, (grads, metrics)), None

    params = jax.tree.map(lambda m: nnx.state(m, trainable(m)), ts.trainable(),
                          is_leaf=lambda x: isinstance(x, nnx.Module))
    zero_metrics = jax.eval_shape(
        lambda mb: loss_fn(nnx.merge(shapes.graphdef, state, copy=True).trainable(), mb,
                           num_tokens, num_seqs)[1],
        jax.tree.map(lambda x: x[:shapes.minibatch // shapes.num_micro], mini))
    zeros = (jax.tree.map(jnp.zeros_like, params),
             jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_metrics))
    (grads, metrics), _ = _scan(
        accumulate, zeros, jax.tree.map(lambda x: split_rows(x, shapes.num_micro), mini))
    return grads, metrics


def value_and_grad(loss_fn, targets, wrt):
    """`(mb, ...) -> ((loss, metrics), grads)` of `loss_fn(targets, mb, ...)` w.r.t. the
    trainable filter `wrt`: one module, or (policy, critic) as two arguments, each with its
    own filter."""
    if not isinstance(targets, tuple):
        return lambda *rest: nnx.value_and_grad(
            loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)(targets, *rest)
    return lambda *rest: nnx.value_and_grad(
        lambda policy, critic, *rest: loss_fn((policy, critic), *rest),
        argnums=(nnx.DiffState(0, wrt[0]), nnx.DiffState(1, wrt[1])),
        has_aux=True)(*targets, *rest)


def apply_if_finite(shapes: UpdateShapes, state: nnx.State, grads: Any, finite: jax.Array
                    ) -> nnx.State:
    """The state after the optimizer step on `grads`, or `state` unchanged (every parameter,
    moment and count) where the loss or gradient was not finite. With one update per step, a
    conditional (a select fused into each parameter's update reads the old moments while
    their own update writes them in place, so XLA copies every moment first); inside the
    updates' loop, an elementwise select of new against old, faster there than the
    conditional."""
    def apply(state, grads):
        ts = nnx.merge(shapes.graphdef, state, copy=True)
        ts.apply_gradients(grads, shapes.cfg.critic.warmup_steps * shapes.cfg.updates_per_step)
        return nnx.state(ts)

    if shapes.cfg.single_update:
        return jax.lax.cond(finite, apply, lambda state, grads: state, state, grads)
    return jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                        apply(state, grads), state)


def adapt_entropy(shapes: UpdateShapes, state: nnx.State, entropy: jax.Array
                  ) -> tuple[nnx.State, jax.Array]:
    """The adaptive entropy coefficient's controller after an update (algo.loss.
    entropy_target; it measures every update, applied or skipped, as TRL): (new state, the
    new coefficient)."""
    ts = nnx.merge(shapes.graphdef, state, copy=True)
    opt = ts.optimizer
    opt.entropy_coef[...] = adapt_entropy_coef(opt.entropy_coef[...], entropy, shapes.cfg.loss)
    opt.last_entropy[...] = entropy
    return nnx.state(ts), opt.entropy_coef[...]


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


def _scan(f, init, xs, length=None):
    """`jax.lax.scan`, or for one step f called as it is (outputs with the scan's leading
    axis of 1): XLA keeps a one-trip loop, whose carry it copies in (the optimizer state's
    moments, weight-sized)."""
    n = length if xs is None else jax.tree.leaves(xs)[0].shape[0]
    if n != 1:
        return jax.lax.scan(f, init, xs, length=length)
    carry, ys = f(init, None if xs is None else jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], ys)
