"""Reward shaping: DAPO's soft overlong punishment.

With L the completion length, L_max the generation budget and L_cache the soft zone:

    R_length(L) = 0                                 L <= L_max - L_cache
                = ((L_max - L_cache) - L) / L_cache  L_max - L_cache < L <= L_max
                = -1                                 L > L_max

The penalty falls linearly from 0 to -1 across the last L_cache tokens of the budget and is
added to the task reward, so a completion is nudged to finish before it is truncated rather
than punished only once it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.rl.settings import check_overlong


def overlong_penalty(lengths_B: jax.Array, max_len: int, cache_len: int) -> jax.Array:
    """R_length(L) of DAPO (module docstring): 0, then linear down to -1, then -1; float32."""
    check_overlong(max_len, cache_len)
    length_B = lengths_B.astype(jnp.float32)
    soft_start = max_len - cache_len
    linear_B = (soft_start - length_B) / cache_len
    return jnp.where(length_B <= soft_start, 0.0, jnp.where(length_B <= max_len, linear_B, -1.0))
