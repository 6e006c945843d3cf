"""The train state (policy + optimizer), created already sharded, and the KL reference copy.

`TrainState` is an nnx Module holding the policy (`model`) and an `nnx.Optimizer` over its
trainable parameters (`optimizer`: the optax state and the update count `step`): every
`nnx.Param`, or with LoRA only the adapters' `nnx.LoRAParam`s (`jaxrl.models.lora.trainable`),
so the frozen base has neither gradients nor Adam moments. nnx.Optimizer copies
each parameter's metadata, logical axes included, onto its Adam moments, so one
`state_shardings` call places every moment exactly like its parameter; the counters carry no
axes and are replicated.

`create_train_state` follows the nanodo recipe through `create_sharded`: `nnx.eval_shape`
of the whole state -> shardings from the rules -> `jax.jit(init, out_shardings=...)`, so
neither parameters nor moments ever exist whole on one device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxrl.config import OptimSection
from jaxrl.models.lora import trainable
from jaxrl.sharding import AxisRules, create_sharded, state_shardings
from jaxrl.step.optimizer import make_optimizer, weight_decay_mask


class SkipCount(nnx.Variable):
    """A counter of steps with skipped updates (int32 scalar, replicated)."""


class TrainState(nnx.Module):
    """The policy and its optimizer; a jitted step takes `nnx.split(train_state)` and donates it."""

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation):
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=trainable(model))
        # Kept with the optimizer state (and its checkpoint): steps with a skipped update.
        self.optimizer.skipped_steps = SkipCount(jnp.zeros((), jnp.int32))
        self.optimizer.skipped_in_a_row = SkipCount(jnp.zeros((), jnp.int32))

    @property
    def step(self) -> jax.Array:
        """Updates applied so far (uint32); the schedule's `t` of the next update."""
        return self.optimizer.step[...]

    def apply_gradients(self, grads: nnx.State) -> None:
        """One optimizer update of the trainable params, in place; `grads` as from `nnx.grad`
        with `trainable(model)`."""
        self.optimizer.update(self.model, grads)

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


def create_train_state(build_model: Callable[[], nnx.Module], optim_cfg: OptimSection,
                       mesh: Mesh, rules: AxisRules) -> TrainState:
    """The policy from `build_model()` (which seeds its own RNG) and its optimizer state,
    created straight into `rules` on `mesh`.
    """
    # The decay mask needs the parameters' logical axes, which the optimizer never sees.
    abstract = nnx.eval_shape(build_model)
    mask = weight_decay_mask(nnx.state(abstract, trainable(abstract)))
    tx = make_optimizer(optim_cfg, mask)
    return create_sharded(lambda: TrainState(build_model(), tx), mesh, rules)


def train_state_from_model(model: nnx.Module, optim_cfg: OptimSection, mesh: Mesh,
                           rules: AxisRules) -> TrainState:
    """A TrainState around an already built (loaded) policy, its optimizer state created
    straight into `rules` on `mesh`.

    The model's arrays are donated to the program that builds the state: `model` must not be
    used afterwards (use the returned state's `.model`).
    """
    mask = weight_decay_mask(nnx.state(model, trainable(model)))
    tx = make_optimizer(optim_cfg, mask)
    graphdef, state = nnx.split(model)

    def build(state):
        return nnx.split(TrainState(nnx.merge(graphdef, state), tx))

    ts_graphdef, abstract = jax.eval_shape(build, state)
    shardings = state_shardings(abstract, mesh, rules)
    out = jax.jit(lambda s: build(s)[1], out_shardings=shardings, donate_argnums=0)(state)
    return nnx.merge(ts_graphdef, out)


def reference_params(state: TrainState) -> nnx.State | None:
    """A frozen copy of the policy's Params, for the KL term (needed only when beta > 0);
    None with LoRA, whose reference is the base model itself (`train_on`).

    The copy has its own buffers with the same shardings: a step that donates the train state
    would otherwise delete the reference with it. Run it as
    `nnx.merge(nnx.graphdef(state.model), ref)`; pass it to the step as a non-donated,
    non-differentiated argument. It costs one more copy of the parameters in memory.
    """
    if trainable(state.model) is nnx.LoRAParam:
        return None
    return jax.tree.map(lambda x: x.copy(), nnx.state(state.model, nnx.Param))
