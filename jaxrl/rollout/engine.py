"""The rollout interface the trainer uses, and jaxrl's own engine behind it.

    engine.generate(params, prompts, key) -> Rollout

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

from jaxrl.rollout.sampler import Rollout, SamplerConfig, sample
from jaxrl.sharding import AxisRules, state_shardings, use_rules


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

    def generate(self, params: nnx.State, prompts: Prompts, key: jax.Array) -> Rollout:
        return self._generate(params, prompts, key)

    def generate_traced(self, params: nnx.State, prompts: Prompts, key: jax.Array) -> Rollout:
        """The pure body of `generate`, to compose into a larger jitted program (the RL step)."""
        # Cast before resharding: the model casts every weight to the compute dtype at use
        # anyway, so gathering (and holding) the rollout copy in it halves the traffic of
        # fp32 weights with bf16 compute and changes no result.
        dtype = nnx.merge(self.graphdef, params).config.compute_dtype
        params = jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        if self.mesh is None:
            return sample(nnx.merge(self.graphdef, params), *prompts, key, self.config)
        params = jax.lax.with_sharding_constraint(
            params, state_shardings(params, self.mesh, self.rules))
        rows = self.rules.sharding(("batch", "seq"), prompts.ids_BxP.shape, self.mesh)
        prompts = Prompts(*(jax.lax.with_sharding_constraint(x, rows) for x in prompts))
        with use_rules(self.mesh, self.rules):
            return sample(nnx.merge(self.graphdef, params), *prompts, key, self.config)
