"""The dense reference sampler: the test oracle the engine is checked against, not the engine.

The engine (`jaxrl.rollout.slots`, driven by `jaxrl.rollout.decode_loop`) does not use it;
`Sampler` runs it when `SamplerConfig.engine` is None, tests check the engine against it, and
FLOP accounting lowers its phases. It is the plainest correct rollout: prefill left-padded
prompts once, then decode every row in a `lax.while_loop` over a dense cache.

    cache, logits = model.extend(prompts)                 prefill, one pass over B prompts
    repeat cache and last logits n times                  the GRPO group shares the prefill
    token_0 ~ logits
    while t < max_new_tokens and some row is unfinished:  one token per row per step
        logits, cache = model.extend(token_{t-1});  token_t ~ logits

A row finishes at its first stop token (kept in the completion and its mask); later slots
hold `pad_token_id` with mask 0. The loop exits as soon as every row has finished, so
`num_steps` (filled completion columns) is the longest completion and the decode loop ran
`num_steps - 1` one-token forward passes. Row `b` draws with its own key, derived from its
prompt's key, so a prompt sampled alone or inside any batch gets the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import KVCache, Transformer, default_positions
from jaxrl.rollout.sampling import sample_rows
from jaxrl.rollout.types import Rollout, SamplerConfig, prompt_keys
from jaxrl.sharding import constrain


def dense_prefill(model: Transformer, prompt_ids_BxP: jax.Array, prompt_mask_BxP: jax.Array,
                  max_new_tokens: int) -> tuple[jax.Array, KVCache, jax.Array]:
    """(last column's logits_BxV, cache, positions_BxP): one pass over the prompts into an
    empty cache of P + max_new_tokens - 1 slots (the last sampled token is never fed back)."""
    num_prompts, prompt_len = prompt_ids_BxP.shape
    cache = KVCache.init(model.config, num_prompts, prompt_len + max_new_tokens - 1)
    positions_BxP = default_positions(prompt_mask_BxP)
    logits_Bx1xV, cache = model.extend(prompt_ids_BxP, positions_BxP, cache,
                                       prompt_mask_BxP.astype(bool), last_only=True)
    return logits_Bx1xV[:, 0], cache, positions_BxP


def dense_decode_step(model: Transformer, token_B: jax.Array, position_B: jax.Array,
                      cache: KVCache) -> tuple[jax.Array, KVCache]:
    """(logits_BxV, cache): one token per row appended to the cache, attending over all of it."""
    logits_Bx1xV, cache = model.extend(token_B[:, None], position_B[:, None], cache)
    return logits_Bx1xV[:, 0], cache


def sample_dense(model: Transformer, prompt_ids_BxP: jax.Array, prompt_mask_BxP: jax.Array,
                 key: jax.Array, config: SamplerConfig) -> Rollout:
    """Samples `num_generations` completions per left-padded prompt (pure; call under jit)."""
    num_prompts = prompt_ids_BxP.shape[0]
    n, steps = config.num_generations, config.max_new_tokens
    prompt_mask_BxP = prompt_mask_BxP.astype(bool)

    # NNX transforms (the layer scan) reject Variables made at another trace level (outside
    # this jit, or outside the decode loop), so each traced scope uses a copy of the model:
    # fresh Variables holding the same arrays.
    graphdef, weights = nnx.split(model)

    logits_BxV, cache, positions_BxP = dense_prefill(
        nnx.merge(graphdef, weights, copy=True), prompt_ids_BxP, prompt_mask_BxP, steps)

    def repeat(x, axis):
        return jnp.repeat(x, n, axis=axis)

    cache = KVCache(repeat(cache.k, 1), repeat(cache.v, 1), repeat(cache.valid_BxS, 0), cache.end)
    logits_BxV = repeat(logits_BxV, 0)
    next_position_B = repeat(positions_BxP[:, -1] + 1, 0)
    row_keys_B = jax.vmap(lambda k: jax.random.split(k, n))(
        prompt_keys(key, num_prompts)).reshape(-1)
    batch = num_prompts * n
    stop_ids = jnp.asarray(config.end_token_ids or (-1,), jnp.int32)

    def draw(t, logits_BxV, done_B, out):
        keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys_B, t)
        token_B, logp_B, logp_raw_B = sample_rows(keys_B, logits_BxV, config.sampling)
        active_B = ~done_B
        token_B = jnp.where(active_B, token_B, config.pad_token_id)
        tokens_BxC, mask_BxC, logp_BxC, logp_raw_BxC = out
        out = (tokens_BxC.at[:, t].set(token_B), mask_BxC.at[:, t].set(active_B),
               logp_BxC.at[:, t].set(jnp.where(active_B, logp_B, 0.0)),
               logp_raw_BxC.at[:, t].set(jnp.where(active_B, logp_raw_B, 0.0)))
        return token_B, done_B | jnp.isin(token_B, stop_ids), out

    out = (jnp.full((batch, steps), config.pad_token_id, jnp.int32),
           jnp.zeros((batch, steps), bool),
           jnp.zeros((batch, steps), jnp.float32), jnp.zeros((batch, steps), jnp.float32))
    token_B, done_B, out = draw(0, logits_BxV, jnp.zeros((batch,), bool), out)

    def cond(state):
        t, _, _, done_B, _, _ = state
        return (t < steps) & ~jnp.all(done_B)

    def body(state):
        t, token_B, cache, done_B, position_B, out = state
        logits_BxV, cache = dense_decode_step(nnx.merge(graphdef, weights, copy=True), token_B,
                                              position_B, cache)
        token_B, done_B, out = draw(t, logits_BxV, done_B, out)
        return t + 1, token_B, cache, done_B, position_B + 1, out

    state = (jnp.int32(1), token_B, cache, done_B, next_position_B, out)
    num_steps, _, _, _, _, out = jax.lax.while_loop(cond, body, state)
    # Every row output is split over the batch axes, also when the prompts alone (fewer rows)
    # did not divide them and were replicated.
    tokens_BxC, mask_BxC, logp_BxC, logp_raw_BxC, prompt_ids_BxP, prompt_mask_BxP = (
        constrain(x, ("batch", "seq")) for x in (*out, repeat(prompt_ids_BxP, 0),
                                                 repeat(prompt_mask_BxP, 0)))
    return Rollout(
        prompt_ids_BxP=prompt_ids_BxP, prompt_mask_BxP=prompt_mask_BxP,
        completion_ids_BxC=tokens_BxC, completion_mask_BxC=mask_BxC, logp_BxC=logp_BxC,
        logp_raw_BxC=logp_raw_BxC, num_steps=num_steps,
        decode_slot_steps=batch * (num_steps - 1))
