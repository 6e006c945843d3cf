"""The asynchronous step's batches: what a batch is, one made or in flight, its staleness.

`Produced` is a queue entry of `jaxrl.step.asynchronous.QueuedRollouts` (and, via `saved`, what
`jaxrl.run.async_queue` checkpoints); `token_staleness` the per-token staleness metrics of a
batch generated with in-flight weight updates.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.rl import RewardInputs
from jaxrl.rollout import Rollout
from jaxrl.rollout.inflight import Partial


@dataclasses.dataclass
class Produced:
    """A rollout dispatched on the rollout mesh, with the weight version it was started from.
    With in-flight updates it is first a `Partial` (with its batch's fields and rows) and
    then, once finished, a rollout with each token's weight version (`version_BxC`)."""

    step: int
    version: int
    rollout: Rollout | None
    inputs: RewardInputs | None
    version_BxC: jax.Array | None = None
    partial: tuple[Partial, dict[str, jax.Array], jax.Array] | None = None

    @property
    def made(self) -> bool:
        """Whether the rollout is finished (else `partial` holds it in flight)."""
        return self.rollout is not None

    def saved(self) -> Any:
        """The arrays a checkpoint keeps of it: (rollout, inputs, version_BxC) when made,
        else (partial, fields_P, rows_P)."""
        return (self.rollout, self.inputs, self.version_BxC) if self.made else self.partial



@jax.jit
def token_staleness(version_BxC: jax.Array, mask_BxC: jax.Array, step: int
                     ) -> tuple[jax.Array, jax.Array]:
    """(mean, max) over the rollout's tokens of the updates between the weights that drew
    each token and those it trains (`step` updates)."""
    stale_BxC = (step - version_BxC).astype(jnp.float32)
    mean = jnp.sum(jnp.where(mask_BxC, stale_BxC, 0)) / jnp.maximum(jnp.sum(mask_BxC), 1)
    return mean, jnp.max(jnp.where(mask_BxC, stale_BxC, 0))
