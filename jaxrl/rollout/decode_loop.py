"""The engine's loop: a rollout planned, begun, advanced and read out.

    plan_    = plan(model.config, engine_config, P, L, B, C, stop_ids, sampling)   static
    progress = begin(model, plan_, prompts, row_keys_B, limit_B, ...)  prefill, first tokens
    progress = advance(model, plan_, progress, row_keys_B)             decode until all end
    rollout  = to_rollout(progress.state, prompts, G, progress.slot_steps)

`advance` is one `lax.while_loop` over the primitives of `jaxrl.rollout.continuous`: whenever
slots are free it inserts the next pending rows (continuous batching; `static` waits until
every slot is free, then inserts a whole batch), then decodes one token for every live slot.
With `stop_at` it stops after that many iterations in all; the `InProgress` it returns goes
on in a later call, in another program, even under other weights (in-flight weight updates:
`jaxrl.rollout.inflight`). A row's token t is drawn with fold_in(key_r, t), so where the
pieces stop changes no token when the weights stay the same. `rollout` is the one-piece
loop (with `min_slots`: in tiers of ever fewer slots, `shrink`), `sample_continuous` the
dense sampler's interface on it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxrl.models import Transformer
from jaxrl.rollout.continuous import (
    DecodeState,
    EngineConfig,
    Prefix,
    admit,
    generate,
    init_decode_state,
    insert,
    max_concurrent_decodes,
    prefill_group,
    resolve_attention,
    shrink,
    slot_tiers,
)
from jaxrl.rollout.pages import PoolLayout
from jaxrl.rollout.sampler import Rollout, SamplerConfig, prompt_keys
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.sharding import constrain


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static part of one rollout: its pool, engine settings (attention resolved), group
    size, stop tokens and sampling; `plan` makes it from the shapes of the call."""

    layout: PoolLayout
    config: EngineConfig
    group_size: int
    stop_token_ids: tuple[int, ...]
    sampling: SamplingParams

    @property
    def stop_ids(self) -> jax.Array:
        return jnp.asarray(self.stop_token_ids or (-1,), jnp.int32)


def plan(model_config, config: EngineConfig, num_prompts: int, prompt_len: int, num_rows: int,
         max_new_tokens: int, stop_token_ids: tuple[int, ...], sampling: SamplingParams) -> Plan:
    """The `Plan` of `num_rows` rows of `num_prompts` prompts up to `prompt_len` tokens."""
    slots = max_concurrent_decodes(config, num_rows)
    layout = PoolLayout.plan(page_size=config.page_size, num_prompts=num_prompts,
                             prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                             num_slots=slots, row_pages=config.row_pages)
    config = dataclasses.replace(config, attention=resolve_attention(
        config.attention, model_config, layout, slots))
    return Plan(layout, config, num_rows // num_prompts, tuple(stop_token_ids), sampling)


@struct.dataclass
class InProgress:
    """A rollout between two decode iterations: all the loop carries, so it can stop after
    any iteration and go on in another program, with other weights (`advance`)."""

    state: DecodeState
    prefix: Prefix
    limit_B: jax.Array
    queue_B: jax.Array  # rows in the order they take slots (those that ended at once last)
    num_queued: jax.Array
    next_: jax.Array  # queue position of the next row to start
    steps: jax.Array  # decode iterations run
    slot_steps: jax.Array  # slots those iterations ran, live or not

    @property
    def finished(self) -> jax.Array:
        return (self.next_ >= self.num_queued) & ~jnp.any(self.state.live_S)


def begin(model: Transformer, plan_: Plan, prompt_ids_PxL: jax.Array,
          prompt_mask_PxL: jax.Array, row_keys_B: jax.Array, limit_B: jax.Array,
          max_new_tokens: int, pad_token_id: int) -> InProgress:
    """An empty pool, the prompts prefilled and every row's first token drawn; no decode
    iteration run yet."""
    b = row_keys_B.shape[0]
    slots = max_concurrent_decodes(plan_.config, b)
    state = init_decode_state(model, plan_.layout, slots, b, max_new_tokens, pad_token_id)
    state, prefix = prefill_group(model, state, plan_.layout, prompt_ids_PxL, prompt_mask_PxL,
                                  row_keys_B, limit_B, plan_.stop_ids, plan_.sampling)
    # Rows that ended on their first token never take a slot; the others queue in row order.
    queue_B = jnp.argsort(prefix.done_B, stable=True).astype(jnp.int32)
    zero = jnp.int32(0)
    return InProgress(state, prefix, limit_B, queue_B, jnp.sum(~prefix.done_B, dtype=jnp.int32),
                      zero, zero, zero)


def advance(model: Transformer, plan_: Plan, progress: InProgress, row_keys_B: jax.Array,
            stop_at: jax.Array | None = None, below: int = 0) -> InProgress:
    """Decode iterations until every row has finished (with `below`: until no row waits and
    at most `below` rows live), or until `stop_at` iterations have run in all."""
    graphdef, weights = nnx.split(model)
    config, layout, g = plan_.config, plan_.layout, plan_.group_size
    limit_B, queue_B, num_queued = progress.limit_B, progress.queue_B, progress.num_queued

    def admit_and_insert(state, next_):
        slot_row_S, next_ = admit(state, progress.prefix, layout, queue_B, num_queued, next_,
                                  limit_B, g, config.batching)
        return insert(state, progress.prefix, layout, slot_row_S, limit_B, g), next_

    def body(p: InProgress) -> InProgress:
        # Only while rows wait and a slot is free (most iterations skip the bookkeeping).
        state, next_ = jax.lax.cond((p.next_ < num_queued) & ~jnp.all(p.state.live_S),
                                    admit_and_insert, lambda st, n: (st, n), p.state, p.next_)
        state, _ = generate(nnx.merge(graphdef, weights, copy=True), state, p.prefix, layout,
                            config, row_keys_B, limit_B, plan_.stop_ids, g, plan_.sampling)
        return p.replace(state=state, next_=next_, steps=p.steps + 1,
                         slot_steps=p.slot_steps + state.row_S.shape[0])

    def cond(p: InProgress) -> jax.Array:
        work = (p.next_ < num_queued) | (jnp.sum(p.state.live_S) > below)
        return work if stop_at is None else work & (p.steps < stop_at)

    return jax.lax.while_loop(cond, body, progress)


def rollout(model: Transformer, prompt_ids_PxL: jax.Array, prompt_mask_PxL: jax.Array,
            row_keys_B: jax.Array, limit_B: jax.Array, max_new_tokens: int,
            config: EngineConfig, *, stop_token_ids: tuple[int, ...], pad_token_id: int,
            sampling: SamplingParams) -> tuple[DecodeState, jax.Array, jax.Array]:
    """(state, iterations, slot steps): every row's completion (in the state's [B, C]
    outputs), the decode iterations run and the slots they ran (live or not) summed.

    `config.min_slots`: once no row waits, whenever the live rows fit in half the slots they
    move there (`shrink`), down to `min_slots`: each tier is its own `while_loop`, so one more
    compiled decode step, and the tail of long rows stops paying for free slots."""
    num_prompts, prompt_len = prompt_ids_PxL.shape
    plan_ = plan(model.config, config, num_prompts, prompt_len, row_keys_B.shape[0],
                 max_new_tokens, stop_token_ids, sampling)
    progress = begin(model, plan_, prompt_ids_PxL, prompt_mask_PxL, row_keys_B, limit_B,
                     max_new_tokens, pad_token_id)
    tiers = slot_tiers(progress.state.row_S.shape[0], config.min_slots)
    for k, num_slots in enumerate(tiers):
        if k:
            progress = progress.replace(state=shrink(progress.state, num_slots))
        # Tier k runs while rows wait or more rows live than the next tier has slots.
        below = tiers[k + 1] if k + 1 < len(tiers) else 0
        progress = advance(model, plan_, progress, row_keys_B, below=below)
    return progress.state, progress.steps, progress.slot_steps



def row_keys(key: jax.Array, num_prompts: int, group_size: int) -> jax.Array:
    """The B = P x G rows' keys of one call's `key` (the dense sampler's, row for row)."""
    return jax.vmap(lambda k: jax.random.split(k, group_size))(
        prompt_keys(key, num_prompts)).reshape(-1)


def row_limits(limit_B: jax.Array | None, num_rows: int, max_new_tokens: int) -> jax.Array:
    """Each row's cap on new tokens, in [1, max_new_tokens] (None: max_new_tokens)."""
    if limit_B is None:
        return jnp.full((num_rows,), max_new_tokens, jnp.int32)
    return jnp.clip(limit_B.astype(jnp.int32), 1, max_new_tokens)


def to_rollout(state: DecodeState, prompt_ids_PxL: jax.Array, prompt_mask_PxL: jax.Array,
               group_size: int, slot_steps: jax.Array) -> Rollout:
    """The finished rows of `state` as the dense sampler's `Rollout`, laid out by rows."""
    def repeat(x):
        return jnp.repeat(x, group_size, axis=0)

    mask_BxC = state.mask_BxC
    tokens_BxC, mask_BxC, logp_BxC, logp_raw_BxC, ids_BxL, pmask_BxL = (
        constrain(x, ("batch", "seq")) for x in (
            state.tokens_BxC, mask_BxC, state.logp_BxC, state.logp_raw_BxC,
            repeat(prompt_ids_PxL), repeat(prompt_mask_PxL.astype(bool))))
    return Rollout(prompt_ids_BxP=ids_BxL, prompt_mask_BxP=pmask_BxL,
                   completion_ids_BxC=tokens_BxC, completion_mask_BxC=mask_BxC,
                   logp_BxC=logp_BxC, logp_raw_BxC=logp_raw_BxC,
                   num_steps=jnp.max(jnp.sum(mask_BxC, axis=1, dtype=jnp.int32)),
                   decode_slot_steps=slot_steps)


def sample_continuous(model: Transformer, prompt_ids_PxL: jax.Array, prompt_mask_PxL: jax.Array,
                      key: jax.Array, config: SamplerConfig,
                      limit_B: jax.Array | None = None) -> Rollout:
    """`sampler.sample` on the engine: the same Rollout, row for row (pure; call under jit).

    `limit_B` (int32 [B]) caps each row's new tokens (default: all `config.max_new_tokens`).
    """
    num_prompts = prompt_ids_PxL.shape[0]
    n = config.num_generations
    keys_B = row_keys(key, num_prompts, n)
    limit_B = row_limits(limit_B, keys_B.shape[0], config.max_new_tokens)
    state, _, slot_steps = rollout(
        model, prompt_ids_PxL, prompt_mask_PxL, keys_B, limit_B, config.max_new_tokens,
        engine_config(config, keys_B.shape[0]), stop_token_ids=config.stop_token_ids,
        pad_token_id=config.pad_token_id, sampling=config.sampling)
    return to_rollout(state, prompt_ids_PxL, prompt_mask_PxL, n, slot_steps)


def engine_config(config: SamplerConfig, num_rows: int) -> EngineConfig:
    """The sampler's engine settings (none given: every row in its own slot)."""
    return config.engine or EngineConfig(max_slots=num_rows)
