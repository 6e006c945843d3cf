"""PPO's critic as a module: a value head, on the policy's trunk or on a trunk of its own.

    value_BxC = hidden_BxCxE · w_E + b                     (float32)

`hidden_BxCxE` are the final-norm hidden states at the positions that predict the completion
tokens (`jaxrl.step.forward.completion_hidden`), so value t is the critic's estimate for the
state *before* completion token t is sampled (the prefix), as GAE (`jaxrl.rl.gae`) needs.

`Critic.trunk` is None for `algo.critic.kind: value_head` (the head reads the policy's own
hidden states, and the value loss trains the shared trunk through them) and a Transformer
for `separate`, initialised from the policy's weights (its vocabulary projection is unused).
The head starts at zero (w = 0, b = 0): the first values are 0 for every state, and at the
start the value loss sends no gradient into a shared trunk, so a value head leaves the
policy's first updates as GRPO-like as a separate critic does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import Transformer
from jaxrl.models.layers import param


class ValueHead(nnx.Module):
    """value_BxC = hidden_BxCxE · w_E + b, zero-initialised, in float32."""

    def __init__(self, hidden_size: int):
        self.kernel = param(jnp.zeros((hidden_size,), jnp.float32), ("embed",))
        self.bias = param(jnp.zeros((), jnp.float32), ())

    def __call__(self, hidden_BxCxE: jax.Array) -> jax.Array:
        return (jnp.einsum("bce,e->bc", hidden_BxCxE.astype(jnp.float32), self.kernel[...])
                + self.bias[...])


class Critic(nnx.Module):
    """A value head and, for a separate critic, its own transformer trunk (module docstring)."""

    def __init__(self, hidden_size: int, trunk: Transformer | None = None):
        self.trunk = trunk
        self.head = ValueHead(hidden_size)
