"""The KV-cache sampler: prefill left-padded prompts once, then decode in a `lax.while_loop`.

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

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

from jaxrl.models import KVCache, Transformer, default_positions
from jaxrl.rollout.sampling import SamplingParams, sample_tokens
from jaxrl.sharding import constrain
from jaxrl.sharding.rules import active_rules


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """What one `generate` call produces."""

    max_new_tokens: int
    num_generations: int = 1
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    # The paged, continuous-batching engine (`jaxrl.rollout.continuous.EngineConfig`);
    # None: this module's static dense sampler (the reference the engine is tested against).
    engine: Any = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.num_generations}")


@struct.dataclass
class Rollout:
    """B = prompts x num_generations rows, prompt-major (row p*n + g is sample g of prompt p).

    logp_BxC is under the distribution sampled from (temperature, top-k, top-p applied);
    logp_raw_BxC under the model at temperature 1. Both are 0 where the mask is 0.

    A multi-turn rollout (`jaxrl.rollout.multiturn`) also sets `observation_mask_BxC`: 1 on
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


def sample_rows(keys_B: jax.Array, logits_BxV: jax.Array,
                 params: SamplingParams) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sample_tokens`, run per device on its own rows when a mesh is active.

    Rows are independent, but XLA partitions `lax.top_k` by gathering every row's logits
    onto every device (measured: an all-gather of [B, V] per decode step); under
    `shard_map` each device samples its rows from the full vocabulary it holds.
    """
    active = active_rules()
    if active is None:
        return sample_tokens(keys_B, logits_BxV, params)
    mesh, rules = active
    rows = rules.spec(("batch",), logits_BxV.shape[:1], mesh)
    rows_axes = rows[0] if len(rows) else None
    per_device = jax.shard_map(
        functools.partial(sample_tokens, params=params), mesh=mesh,
        in_specs=(P(rows_axes), P(rows_axes, None)), out_specs=(P(rows_axes),) * 3)
    return per_device(keys_B, logits_BxV)


def prompt_keys(key: jax.Array, num_prompts: int) -> jax.Array:
    """Per-prompt keys from one key, or the given [num_prompts] keys unchanged."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.shape == ():
        return jax.random.split(key, num_prompts)
    if key.shape != (num_prompts,):
        raise ValueError(f"expected one key or {num_prompts} prompt keys, got shape {key.shape}")
    return key


def prefill(model: Transformer, prompt_ids_BxP: jax.Array, prompt_mask_BxP: jax.Array,
            max_new_tokens: int) -> tuple[jax.Array, KVCache, jax.Array]:
    """(last column's logits_BxV, cache, positions_BxP): one pass over the prompts into an
    empty cache of P + max_new_tokens - 1 slots (the last sampled token is never fed back)."""
    num_prompts, prompt_len = prompt_ids_BxP.shape
    cache = KVCache.init(model.config, num_prompts, prompt_len + max_new_tokens - 1)
    positions_BxP = default_positions(prompt_mask_BxP)
    logits_Bx1xV, cache = model.extend(prompt_ids_BxP, positions_BxP, cache,
                                       prompt_mask_BxP.astype(bool), last_only=True)
    return logits_Bx1xV[:, 0], cache, positions_BxP


def decode_step(model: Transformer, token_B: jax.Array, position_B: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
    """(logits_BxV, cache): one token per row appended to the cache, attending over all of it."""
    logits_Bx1xV, cache = model.extend(token_B[:, None], position_B[:, None], cache)
    return logits_Bx1xV[:, 0], cache


def sample(model: Transformer, prompt_ids_BxP: jax.Array, prompt_mask_BxP: jax.Array,
           key: jax.Array, config: SamplerConfig) -> Rollout:
    """Samples `num_generations` completions per left-padded prompt (pure; call under jit)."""
    num_prompts = prompt_ids_BxP.shape[0]
    n, steps = config.num_generations, config.max_new_tokens
    prompt_mask_BxP = prompt_mask_BxP.astype(bool)

    # NNX transforms (the layer scan) reject Variables made at another trace level (outside
    # this jit, or outside the decode loop), so each traced scope uses a copy of the model:
    # fresh Variables holding the same arrays.
    graphdef, weights = nnx.split(model)

    logits_BxV, cache, positions_BxP = prefill(
        nnx.merge(graphdef, weights, copy=True), prompt_ids_BxP, prompt_mask_BxP, steps)

    def repeat(x, axis):
        return jnp.repeat(x, n, axis=axis)

    cache = KVCache(repeat(cache.k, 1), repeat(cache.v, 1), repeat(cache.valid_BxS, 0), cache.end)
    logits_BxV = repeat(logits_BxV, 0)
    next_position_B = repeat(positions_BxP[:, -1] + 1, 0)
    row_keys_B = jax.vmap(lambda k: jax.random.split(k, n))(
        prompt_keys(key, num_prompts)).reshape(-1)
    batch = num_prompts * n
    stop_ids = jnp.asarray(config.stop_token_ids or (-1,), jnp.int32)

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
        logits_BxV, cache = decode_step(nnx.merge(graphdef, weights, copy=True), token_B,
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
