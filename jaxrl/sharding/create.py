"""Create NNX state already sharded: `eval_shape` -> shardings -> `jit(init, out_shardings=...)`.

No parameter is ever materialised whole on one device: XLA runs the initialiser directly
into the sharded layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxrl.sharding.rules import AxisRules, state_shardings

M = TypeVar("M", bound=nnx.Module)


def create_sharded(build: Callable[[], M], mesh: Mesh, rules: AxisRules) -> M:
    """Runs `build()` (a module constructor with its own RNG) straight into `rules` on `mesh`."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
    shardings = state_shardings(abstract_state, mesh, rules)
    state = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def reshard(module: nnx.Module, mesh: Mesh, rules: AxisRules) -> None:
    """Moves every variable of `module` onto `rules` on `mesh`, in place."""
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, state_shardings(state, mesh, rules)))
