"""What every rollout driver shares: the `Rollout` it returns, the call's settings
(`SamplerConfig`), and how a call's key and caps become each row's.

A call of P prompts x G samples has B = P x G rows, prompt-major (row p * G + g is sample g
of prompt p); row r draws its completion token t with fold_in(key_r, t), key_r split from
its prompt's key, so a row's tokens depend on neither the batch nor the engine's slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.rollout.settings import Generation


@dataclasses.dataclass(frozen=True)
class SamplerConfig(Generation):
    """What one `generate` call produces: a `Generation` (made from the config's rollout
    section by `SamplerConfig.of(cfg.rollout, ...)`), a completion ending at any of
    `end_token_ids` (the EOS ids and the config's `rollout.stop_token_ids`) and padded with
    `pad_token_id`. A single-turn call ignores `max_turns` and
    `max_total_tokens` (multi-turn's: `jaxrl.step.multiturn_rollout`)."""

    end_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0


@struct.dataclass
class Rollout:
    """B = prompts x num_generations rows, prompt-major (row p*n + g is sample g of prompt p).

    logp_BxC is under the distribution sampled from (temperature, top-k, top-p applied);
    logp_raw_BxC under the model at temperature 1. Both are 0 where the mask is 0.

    A multi-turn rollout (`jaxrl.step.multiturn_rollout`) also sets `observation_mask_BxC`: 1 on
    the environments' tokens inside the completion, which the trainer attends over (they are
    in completion_mask_BxC) but never trains on (out of the loss mask; their log-probs 0).
    """

    prompt_ids_BxP: jax.Array
    prompt_mask_BxP: jax.Array
    completion_ids_BxC: jax.Array
    completion_mask_BxC: jax.Array
    logp_BxC: jax.Array
    logp_raw_BxC: jax.Array
    num_steps: jax.Array
    # One-row forward passes the decode loop ran, live or not: rows x (num_steps - 1) here;
    # the engine's slots summed over its iterations. What the decode FLOPs scale with.
    decode_slot_steps: jax.Array
    observation_mask_BxC: jax.Array | None = None

    def model_token_mask(self) -> jax.Array:
        """bool_BxC: the tokens the policy sampled (the completion less any observation)."""
        mask_BxC = self.completion_mask_BxC.astype(bool)
        if self.observation_mask_BxC is None:
            return mask_BxC
        return mask_BxC & ~self.observation_mask_BxC.astype(bool)


def prompt_keys(key: jax.Array, num_prompts: int) -> jax.Array:
    """Per-prompt keys from one key, or the given [num_prompts] keys unchanged."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        return jax.random.split(key, num_prompts)
    if key.shape != (num_prompts,):
        raise ValueError(f"expected one key or {num_prompts} prompt keys, got shape {key.shape}")
    return key


def row_keys(key: jax.Array, num_prompts: int, group_size: int) -> jax.Array:
    """The B = P x G rows' keys of one call's `key` (the dense sampler's, row for row)."""
    return jax.vmap(lambda k: jax.random.split(k, group_size))(
        prompt_keys(key, num_prompts)).reshape(-1)


def row_limits(limit_B: jax.Array | None, num_rows: int, max_new_tokens: int) -> jax.Array:
    """Each row's cap on new tokens, in [1, max_new_tokens] (None: max_new_tokens)."""
    if limit_B is None:
        return jnp.full((num_rows,), max_new_tokens, jnp.int32)
    return jnp.clip(limit_B.astype(jnp.int32), 1, max_new_tokens)
