"""The train state (policy + optimizer), created already sharded, and the KL reference copy.

`TrainState` is an nnx Module holding the policy (`model`) and an `nnx.Optimizer` over its
`nnx.Param`s it trains (`optimizer`: the optax state and the update count `step`): every
`nnx.Param`, or with LoRA only the adapters' `nnx.LoRAParam`s (`jaxrl.models.lora.trainable`),
so the frozen base has neither gradients nor Adam moments. With PPO's critic
(`algo.advantage: gae`) it also holds the `critic` (`jaxrl.step.value_model.Critic`) and its own
`critic_optimizer`, so that donation and checkpoints carry it like the policy. nnx.Optimizer copies
each parameter's metadata, logical axes included, onto its Adam moments, so one
`state_shardings` call places every moment exactly like its parameter; the counters carry no
axes and are replicated.

`create_train_state` follows the nanodo recipe through `create_sharded`: `nnx.eval_shape`
of the whole state -> shardings from the rules -> `jax.jit(init, out_shardings=...)`, so
neither parameters nor moments ever exist whole on one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxrl.config import OptimSection
from jaxrl.config.critic import CriticSection
from jaxrl.models.lora import trainable
from jaxrl.sharding import AxisRules, create_sharded, state_shardings
from jaxrl.step.optimizer import make_optimizer, weight_decay_mask
from jaxrl.step.value_model import Critic


class SkipCount(nnx.Variable):
    """A counter of steps with skipped updates (int32 scalar, replicated)."""


class EntropyControl(nnx.Variable):
    """The adaptive entropy coefficient's state (float32 scalar, replicated)."""


class TrainState(nnx.Module):
    """The policy and its optimizer; a jitted step takes `nnx.split(train_state)` and donates it.

    With `adaptive_entropy_coef` (algo.loss.entropy_target set: `jaxrl.rl.loss_variants`) the
    optimizer also keeps the adaptive coefficient, from that initial value, and the entropy
    of the last update (+inf before the first)."""

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation,
                 critic: Critic | None = None,
                 critic_tx: optax.GradientTransformation | None = None,
                 adaptive_entropy_coef: float | None = None):
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=trainable(model))
        self.critic = critic
        if critic is not None:
            self.critic_optimizer = nnx.Optimizer(critic, critic_tx, wrt=nnx.Param)
        # Kept with the optimizer state (and its checkpoint): steps with a skipped update.
        self.optimizer.skipped_steps = SkipCount(jnp.zeros((), jnp.int32))
        self.optimizer.skipped_in_a_row = SkipCount(jnp.zeros((), jnp.int32))
        if adaptive_entropy_coef is not None:
            self.optimizer.entropy_coef = EntropyControl(jnp.float32(adaptive_entropy_coef))
            self.optimizer.last_entropy = EntropyControl(jnp.float32(jnp.inf))

    @property
    def step(self) -> jax.Array:
        """Updates applied so far (uint32); the schedule's `t` of the next update."""
        return self.optimizer.step[...]

    def trainable(self) -> nnx.Module | tuple[nnx.Module, Critic]:
        """What the loss is differentiated with respect to: the policy, or (policy, critic)."""
        return self.model if self.critic is None else (self.model, self.critic)

    def wrt(self) -> nnx.filterlib.Filter | tuple[nnx.filterlib.Filter, nnx.filterlib.Filter]:
        """Which parameters of `trainable()` get gradients: the policy's optimizer's (with
        LoRA the adapters only), and (policy's, critic's) with a critic: every parameter of
        the critic. One filter per module: nnx's paths inside a tuple do not name its index,
        so one filter over (policy, critic) cannot tell the two apart."""
        policy = trainable(self.model)
        return policy if self.critic is None else (policy, nnx.Param)

    def apply_gradients(self, grads: nnx.State | tuple[nnx.State, nnx.State],
                        critic_warmup_updates: int = 0) -> None:
        """One optimizer update, in place; `grads` as from `nnx.grad` of `trainable()`. With a
        critic: (policy grads, critic grads); the critic is always updated, the policy only
        once the critic has made `critic_warmup_updates` updates (its warm-up)."""
        if self.critic is None:
            self.optimizer.update(self.model, grads)
            return
        grads, critic_grads = grads
        warm = self.critic_optimizer.step[...] >= critic_warmup_updates
        self.critic_optimizer.update(self.critic, critic_grads)
        if not critic_warmup_updates:
            self.optimizer.update(self.model, grads)
            return
        graphdef, policy = nnx.split((self.model, self.optimizer))

        def update(policy, grads):
            model, optimizer = nnx.merge(graphdef, policy, copy=True)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer))

        nnx.update((self.model, self.optimizer),
                   jax.lax.cond(warm, update, lambda policy, grads: policy, policy, grads))

    def count_skips(self, skipped_updates: jax.Array) -> dict[str, jax.Array]:
        """Counts a step that skipped `skipped_updates` updates (non-finite loss or gradient);
        its metrics: this step's skipped updates, steps with any so far, and in a row."""
        opt = self.optimizer
        skipped = skipped_updates > 0
        opt.skipped_steps[...] = opt.skipped_steps[...] + skipped.astype(jnp.int32)
        opt.skipped_in_a_row[...] = jnp.where(skipped, opt.skipped_in_a_row[...] + 1, 0)
        return {"train/skipped_updates": skipped_updates,
                "train/skipped_steps": opt.skipped_steps[...],
                "train/skipped_in_a_row": opt.skipped_in_a_row[...]}


def _with_critic(build_model: Callable[[], nnx.Module], tx: optax.GradientTransformation,
                 optim_cfg: OptimSection, critic: CriticSection | None,
                 adaptive_entropy_coef: float | None = None) -> Callable[[], TrainState]:
    """A constructor of the TrainState of `build_model()`'s policy and, when `critic` is
    given, its critic: a value head, on a second `build_model()` (the policy's weights) for
    a separate critic, trained by optim's schedule at `critic.lr`."""
    if critic is None:
        return lambda: TrainState(build_model(), tx,
                                  adaptive_entropy_coef=adaptive_entropy_coef)

    def make_critic() -> Critic:
        model = build_model() if critic.kind == "separate" else None
        hidden = (model or nnx.eval_shape(build_model)).config.hidden_size
        return Critic(hidden, model)

    mask = weight_decay_mask(nnx.state(nnx.eval_shape(make_critic), nnx.Param))
    critic_tx = make_optimizer(dataclasses.replace(optim_cfg, lr=critic.lr or optim_cfg.lr),
                               mask)
    return lambda: TrainState(build_model(), tx, make_critic(), critic_tx, adaptive_entropy_coef)


def create_train_state(build_model: Callable[[], nnx.Module], optim_cfg: OptimSection,
                       mesh: Mesh, rules: AxisRules,
                       critic: CriticSection | None = None,
                       adaptive_entropy_coef: float | None = None) -> TrainState:
    """The policy from `build_model()` (which seeds its own RNG) and its optimizer state,
    created straight into `rules` on `mesh`; with `critic` (algo.advantage gae) the critic
    and its optimizer too (a separate critic's trunk: another `build_model()`); with
    `adaptive_entropy_coef`, that coefficient's state (`TrainState`).
    """
    # The decay mask needs the parameters' logical axes, which the optimizer never sees.
    abstract = nnx.eval_shape(build_model)
    mask = weight_decay_mask(nnx.state(abstract, trainable(abstract)))
    tx = make_optimizer(optim_cfg, mask)
    return create_sharded(_with_critic(build_model, tx, optim_cfg, critic,
                                       adaptive_entropy_coef), mesh, rules)


def train_state_from_model(model: nnx.Module, optim_cfg: OptimSection, mesh: Mesh,
                           rules: AxisRules, critic: CriticSection | None = None,
                           adaptive_entropy_coef: float | None = None) -> TrainState:
    """A TrainState around an already built (loaded) policy, its optimizer state created
    straight into `rules` on `mesh`; with `critic`, the critic too (a separate critic's
    trunk a copy of the policy's weights); `adaptive_entropy_coef` as `create_train_state`.

    The model's arrays are donated to the program that builds the state: `model` must not be
    used afterwards (use the returned state's `.model`).
    """
    mask = weight_decay_mask(nnx.state(model, trainable(model)))
    tx = make_optimizer(optim_cfg, mask)
    graphdef, state = nnx.split(model)

    def build(state):
        # copy=True: a separate critic's trunk gets Variables of its own, not the policy's.
        return nnx.split(_with_critic(lambda: nnx.merge(graphdef, state, copy=True), tx,
                                      optim_cfg, critic, adaptive_entropy_coef)())

    ts_graphdef, abstract = jax.eval_shape(build, state)
    shardings = state_shardings(abstract, mesh, rules)
    out = jax.jit(lambda s: build(s)[1], out_shardings=shardings, donate_argnums=0)(state)
    return nnx.merge(ts_graphdef, out)


def reference_params(state: TrainState) -> nnx.State | None:
    """A frozen copy of the policy's Params, for the KL term (needed only when beta > 0);
    None with LoRA, whose reference is the base model itself (`apply_updates`).

    The copy has its own buffers with the same shardings: a step that donates the train state
    would otherwise delete the reference with it. Run it as
    `nnx.merge(nnx.graphdef(state.model), ref)`; pass it to the step as a non-donated,
    non-differentiated argument. It costs one more copy of the parameters in memory.
    """
    if trainable(state.model) is nnx.LoRAParam:
        return None
    return jax.tree.map(lambda x: x.copy(), nnx.state(state.model, nnx.Param))
