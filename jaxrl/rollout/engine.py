"""The rollout interface the trainer uses, and jaxrl's own engine behind it.

    engine.generate(params, prompts, key) -> Rollout

With `SamplerConfig.engine` set the rows go through the paged, continuous-batching engine
(`jaxrl.rollout.slots` driven by `jaxrl.rollout.decode_loop`: what training, evaluation and
`jaxrl generate` use); without it, through the dense reference sampler
(`jaxrl.rollout.dense_reference`, the oracle tests check the engine against).

`params` is the policy's `nnx.State` in whatever layout the trainer keeps it. jaxrl's engine
compiles the sampler once per prompt shape; on a mesh it reshards the weights to the
rollout rule set (weights on `tensor` only) *inside* the compiled program — XLA all-gathers
them once per call, never per token, and nothing goes through the host. Another engine
(a server, a disaggregated sampler) only has to implement `generate`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxrl.models.lora_merge import rollout_view
from jaxrl.rollout import inflight
from jaxrl.rollout.decode_loop import sample_continuous
from jaxrl.rollout.dense_reference import sample_dense
from jaxrl.rollout.inflight import Partial, constrain_partial
from jaxrl.rollout.types import Rollout, SamplerConfig
from jaxrl.sharding import AxisRules, state_shardings, use_rules


def to_compute_dtype(params: nnx.State, dtype) -> nnx.State:
    """Every floating-point weight cast to `dtype` (an array already in it is kept)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


class Prompts(NamedTuple):
    """Left-padded prompt token ids and their mask (1 = real token)."""

    ids_BxP: jax.Array
    mask_BxP: jax.Array


class RolloutEngine(Protocol):
    def generate(self, params: nnx.State, prompts: Prompts, key: jax.Array) -> Rollout:
        """Samples completions for `prompts` from the policy whose weights are `params`."""
        ...


class Sampler:
    """jaxrl's engine: the policy's own model code, compiled into one program per call."""

    def __init__(self, graphdef: nnx.GraphDef, config: SamplerConfig, *,
                 mesh: Mesh | None = None, rules: AxisRules | None = None):
        if (mesh is None) != (rules is None):
            raise ValueError("pass both mesh and rules (the rollout rule set), or neither")
        self.graphdef, self.config, self.mesh, self.rules = graphdef, config, mesh, rules
        self._generate = jax.jit(self.generate_traced)

    def generate(self, params: nnx.State, prompts: Prompts, key: jax.Array,
                 limits_B: jax.Array | None = None) -> Rollout:
        """`limits_B` (int32, one per row): each row's own cap on new tokens (the engine
        only; default `max_new_tokens` for every row)."""
        return self._generate(params, prompts, key, limits_B)

    def generate_traced(self, params: nnx.State, prompts: Prompts, key: jax.Array,
                        limits_B: jax.Array | None = None) -> Rollout:
        """The pure body of `generate`, to compose into a larger jitted program (the RL step)."""
        if limits_B is not None and self.config.engine is None:
            raise ValueError("per-row limits need the engine (SamplerConfig.engine)")

        def run(model, prompts):
            if self.config.engine is None:
                return sample_dense(model, *prompts, key, self.config)
            return sample_continuous(model, *prompts, key, self.config, limits_B)

        return self._on_rules(run, params, prompts)

    def start_traced(self, params: nnx.State, prompts: Prompts, key: jax.Array,
                     version: jax.Array, stop_at: jax.Array) -> Partial:
        """`jaxrl.rollout.inflight.start` (a rollout in pieces; the engine only)."""
        return self._on_rules(lambda model, prompts: constrain_partial(inflight.start(
            model, self.config, *prompts, key, version, stop_at)), params, prompts)

    def resume_traced(self, params: nnx.State, partial: Partial, version: jax.Array,
                      stop_at: jax.Array) -> Partial:
        """`jaxrl.rollout.inflight.resume`: `partial` decoded on by the weights `params`."""
        return self._on_rules(lambda model, _: constrain_partial(inflight.resume(
            model, self.config, constrain_partial(partial), version, stop_at)), params, None)

    def finish_traced(self, partial: Partial) -> tuple[Rollout, jax.Array]:
        """`jaxrl.rollout.inflight.finish`: (rollout, version_BxC) of a finished rollout."""
        if self.mesh is None:
            return inflight.finish(self.config, partial)
        with use_rules(self.mesh, self.rules):
            return inflight.finish(self.config, constrain_partial(partial))

    def _on_rules(self, run, params: nnx.State, prompts: Prompts | None):
        """`run(model, prompts)` with the policy of `params` (cast to its compute dtype) and
        the prompts laid out by the rollout rules, under them (as given without a mesh)."""
        # Cast before resharding: the model casts every weight to the compute dtype at use
        # anyway, so gathering (and holding) the rollout copy in it halves the traffic of
        # fp32 weights with bf16 compute and changes no result.
        # LoRA with rollout=merged: the adapters folded into the weights, once per call.
        graphdef, params = rollout_view(self.graphdef, params)
        params = to_compute_dtype(params, nnx.merge(graphdef, params).config.compute_dtype)
        if self.mesh is None:
            return run(nnx.merge(graphdef, params), prompts)
        params = jax.lax.with_sharding_constraint(
            params, state_shardings(params, self.mesh, self.rules))
        if prompts is not None:
            rows = self.rules.sharding(("batch", "seq"), prompts.ids_BxP.shape, self.mesh)
            prompts = Prompts(*(jax.lax.with_sharding_constraint(x, rows) for x in prompts))
        with use_rules(self.mesh, self.rules):
            return run(nnx.merge(graphdef, params), prompts)
