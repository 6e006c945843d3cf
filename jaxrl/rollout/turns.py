"""The multi-turn rollout's device side: slots that decode a turn, then take an observation.

    layout           = ServeLayout(slots, P, max_total_tokens, page_size)   (`serving`)
    state            = init_turn_state(model_config, layout)          every slot free
    prefix           = prefill_prompt(model, ids_P, mask_P)           a left-padded prompt's k/v
                                                                      and last logits (once per
                                                                      group of G samples)
    state            = start(state, prefix, key, slot, layout, s)     a row's first token drawn
    state, out_S     = step(model, state, layout, limits, s)          every live slot emits its
                                                                      pending token, draws the next
    state, logits_V  = extend(model, state, slot, ids_W, n, layout, s)
                                                                      the turn's last token and
                                                                      the observation appended
                                                                      as one chunk; next token drawn

Slot s owns pages [s * M, (s + 1) * M) as in `jaxrl.rollout.serving`. A slot is *live*
while it decodes a turn: it holds a pending token (drawn, not yet emitted) with its
log-probs. `step` emits it and ends the slot's turn (live -> 0) on a stop token, the turn's
`max_turn_tokens`-th token or the row's `max_total_tokens`-th completion token; a token that
ends a turn is not fed (its k/v are not written), so `extend` feeds it first, then the
observation's tokens, all in one forward pass of a dense one-row view of the slot's pages.

Completion token t of a row (model and observation tokens counted alike) sits at position
prompt_length + t; a model token t is drawn with fold_in(row key, t), so a row's tokens do not
depend on its slot or on the other rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.models import KVCache, PagedKV, Transformer
from jaxrl.rollout.continuous import pool_kv
from jaxrl.rollout.sampler import prefill as dense_prefill
from jaxrl.rollout.sampler import sample_rows
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.serving import ServeLayout, write_prefix


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    """What ends a turn inside `step`: a token of `stop_token_ids`, the turn's
    `max_turn_tokens`-th token, the row's `max_total_tokens`-th completion token."""

    stop_token_ids: tuple[int, ...]
    max_turn_tokens: int
    max_total_tokens: int


@struct.dataclass
class PromptPrefix:
    """A prompt after `prefill_prompt`: k/v by position ([layers, P, 2K, H], rows past
    `length` unused), its length and the logits that draw its rows' first token."""

    kv_LxPx2KxH: jax.Array
    length: jax.Array
    logits_V: jax.Array


@struct.dataclass
class TurnState:
    """The pool and per slot: live (decoding a turn), its pending token and that token's
    log-probs (`logp` as sampled, `logp_raw` at temperature 1), the position the pending
    token is fed at (after a turn ends: the position of its unfed last token), the row's
    prompt length, the tokens of the current turn so far, and the row's key."""

    kv_pages: jax.Array  # [layers, pages, page_size, 2 * kv_heads, head_dim]
    live_S: jax.Array
    token_S: jax.Array
    logp_S: jax.Array
    logp_raw_S: jax.Array
    pos_S: jax.Array
    base_S: jax.Array
    turn_len_S: jax.Array
    key_S: jax.Array


@struct.dataclass
class TurnTokens:
    """What one `step` gives each slot: the token emitted, whether it is one (the slot was
    live), its completion index, its log-probs, and whether it ended the slot's turn."""

    token_S: jax.Array
    valid_S: jax.Array
    index_S: jax.Array
    logp_S: jax.Array
    logp_raw_S: jax.Array
    ended_S: jax.Array


def init_turn_state(model_config, layout: ServeLayout) -> TurnState:
    c, s = model_config, layout.num_slots
    shape = (c.num_layers, layout.num_pages, layout.page_size, 2 * c.num_kv_heads, c.head_dim)
    ints = [jnp.zeros((s,), jnp.int32) for _ in range(4)]  # separate buffers (donation)
    return TurnState(jnp.zeros(shape, c.compute_dtype), jnp.zeros((s,), bool), ints[0],
                     jnp.zeros((s,), jnp.float32), jnp.zeros((s,), jnp.float32), ints[1],
                     ints[2], ints[3], jax.random.split(jax.random.key(0), s))


def prefill_prompt(model: Transformer, ids_P: jax.Array, mask_P: jax.Array) -> PromptPrefix:
    """A left-padded prompt through the model once (the RL engine's prefill, same numbers)."""
    width = ids_P.shape[0]
    logits_1xV, cache, _ = dense_prefill(model, ids_P[None], mask_P[None].astype(bool), 1)
    length = jnp.sum(mask_P.astype(jnp.int32))
    column_P = jnp.clip(width - length + jnp.arange(width), 0, width - 1)  # position j's
    return PromptPrefix(pool_kv(cache)[:, 0, column_P], length, logits_1xV[0])


def _draw(key, index, logits_V, sampling):
    token_1, logp_1, logp_raw_1 = sample_rows(jax.random.fold_in(key, index)[None],
                                              logits_V[None], sampling)
    return token_1[0], logp_1[0], logp_raw_1[0]


def start(state: TurnState, prefix: PromptPrefix, key: jax.Array, slot: jax.Array,
          layout: ServeLayout, sampling: SamplingParams) -> TurnState:
    """The slot starts a row of the prefix's prompt: the prompt's k/v into the slot's first
    pages, its first token drawn with fold_in(key, 0)."""
    kv_pages = write_prefix(state.kv_pages, prefix.kv_LxPx2KxH, slot, layout)
    token, logp, logp_raw = _draw(key, 0, prefix.logits_V, sampling)
    return state.replace(
        kv_pages=kv_pages, live_S=state.live_S.at[slot].set(True),
        token_S=state.token_S.at[slot].set(token), logp_S=state.logp_S.at[slot].set(logp),
        logp_raw_S=state.logp_raw_S.at[slot].set(logp_raw),
        pos_S=state.pos_S.at[slot].set(prefix.length),
        base_S=state.base_S.at[slot].set(prefix.length),
        turn_len_S=state.turn_len_S.at[slot].set(0), key_S=state.key_S.at[slot].set(key))


def step(model: Transformer, state: TurnState, layout: ServeLayout, limits: TurnLimits,
         sampling: SamplingParams, attention: str = "xla",
         pages_per_block: int = 8) -> tuple[TurnState, TurnTokens]:
    """Every live slot emits its pending token; a slot whose turn goes on feeds it and draws
    the next (fold_in(key, its completion index)); the others stop until `extend`."""
    index_S = state.pos_S - state.base_S
    turn_len_S = state.turn_len_S + 1
    stop_ids = jnp.asarray(limits.stop_token_ids or (-1,), jnp.int32)
    ended_S = (jnp.isin(state.token_S, stop_ids) | (turn_len_S >= limits.max_turn_tokens)
               | (index_S + 1 >= limits.max_total_tokens))
    out = TurnTokens(state.token_S, state.live_S, index_S, state.logp_S, state.logp_raw_S,
                     state.live_S & ended_S)
    go_S = state.live_S & ~ended_S
    t, pos_S = layout.page_size, state.pos_S
    table = layout.page_table()
    page_S = jnp.take_along_axis(
        table, jnp.clip(pos_S // t, 0, layout.slot_pages - 1)[:, None], axis=1)[:, 0]
    paged = PagedKV(state.kv_pages, table, jnp.where(go_S, pos_S + 1, 0),
                    jnp.where(go_S, page_S, -1), pos_S % t, impl=attention,
                    pages_per_block=pages_per_block)
    logits_SxV, kv_pages = model.decode_paged(state.token_S, pos_S, paged)
    keys_S = jax.vmap(jax.random.fold_in)(state.key_S, index_S + 1)
    next_S, logp_S, logp_raw_S = sample_rows(keys_S, logits_SxV, sampling)

    def keep(new, old):
        return jnp.where(go_S, new, old)

    return state.replace(
        kv_pages=kv_pages, live_S=go_S, token_S=keep(next_S, state.token_S),
        logp_S=keep(logp_S, state.logp_S), logp_raw_S=keep(logp_raw_S, state.logp_raw_S),
        pos_S=keep(pos_S + 1, pos_S),
        turn_len_S=jnp.where(state.live_S, turn_len_S, state.turn_len_S)), out


def extend_slot(model: Transformer, kv_pages: jax.Array, layout: ServeLayout, slot: jax.Array,
                pos: jax.Array, ids_W: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits_V of token n - 1, kv_pages): the first `n` tokens of `ids_W` fed at positions
    pos .. pos + n - 1 of the slot as one chunk, over its earlier positions.

    The slot's pages are gathered into a dense one-row `KVCache` (valid below `pos`), the
    model's cached `extend` runs on the chunk, and the chunk's new keys/values are scattered
    back into the slot's pages (padding columns write nothing)."""
    width, t, m = ids_W.shape[0], layout.page_size, layout.slot_pages
    table_M = layout.page_table()[slot]
    layers, _, _, kk, h = kv_pages.shape
    kv_Lx1xSxKx2xH = kv_pages[:, table_M].reshape(layers, 1, m * t, kk // 2, 2, h)
    room = jnp.zeros((layers, 1, width, kk // 2, h), kv_pages.dtype)  # the chunk never clamps
    k, v = (jnp.concatenate([kv_Lx1xSxKx2xH[..., i, :], room], axis=2) for i in (0, 1))
    valid_1xS = (jnp.arange(m * t + width) < pos)[None]
    real_W = jnp.arange(width) < n
    logits_1xWxV, cache = model.extend(ids_W[None], (pos + jnp.arange(width))[None],
                                       KVCache(k, v, valid_1xS, pos), real_W[None])
    new_LxWx2KxH = pool_kv(cache)[:, 0, pos + jnp.arange(width)]
    p_W = pos + jnp.arange(width)
    page_W = jnp.where(real_W, table_M[jnp.clip(p_W // t, 0, m - 1)], layout.num_pages)
    kv_pages = kv_pages.at[:, page_W, p_W % t].set(new_LxWx2KxH.astype(kv_pages.dtype),
                                                    mode="drop")
    return logits_1xWxV[0, n - 1], kv_pages


def extend(model: Transformer, state: TurnState, slot: jax.Array, ids_W: jax.Array,
           n: jax.Array, layout: ServeLayout, sampling: SamplingParams,
           ) -> tuple[TurnState, jax.Array]:
    """The slot's next `n` tokens (`ids_W[:n]`: after a turn, its last token then the
    observation's) appended at its position; the slot goes live on a new turn with its
    pending token drawn from the chunk's last logits (fold_in(key, its completion index)).
    A long observation may come in several calls (each draws; the last one's token stands).
    Returns (state, the chunk's last logits)."""
    pos = state.pos_S[slot]
    logits_V, kv_pages = extend_slot(model, state.kv_pages, layout, slot, pos, ids_W, n)
    pos = pos + n
    token, logp, logp_raw = _draw(state.key_S[slot], pos - state.base_S[slot], logits_V,
                                  sampling)
    return state.replace(
        kv_pages=kv_pages, live_S=state.live_S.at[slot].set(True),
        token_S=state.token_S.at[slot].set(token), logp_S=state.logp_S.at[slot].set(logp),
        logp_raw_S=state.logp_raw_S.at[slot].set(logp_raw), pos_S=state.pos_S.at[slot].set(pos),
        turn_len_S=state.turn_len_S.at[slot].set(0)), logits_V
