"""The rollout engine: decode slots over a paged KV pool, refilled as rows finish.

JetStream's Engine shape, pure JAX, every function traceable into one compiled program:

    state          = init_decode_state(model, layout, ...)     empty slots, free pages
    state, prefix  = prefill_group(model, state, prompts, ...)  prompts into their pages; the
                                                               first token of each of the G
                                                               samples of every prompt
                     (prefill: the same with G = 1)
    state          = insert(state, prefix, slot_S, row_S)      rows start in slots
    state, tokens  = generate(model, state, prefix, ...)        one token for every live slot
    slots          = max_concurrent_decodes(config, rows)

The loop that runs them (`jaxrl.rollout.decode_loop`) inserts pending rows whenever slots
are free and decodes one token for every live slot until every row has finished. A
row is (prompt p, sample g) at index p * G + g; its token t is drawn with
fold_in(key_r, t), key_r its own key, so a row gets the same tokens in any slot, with any
number of slots and under either batching. A row ends at its first stop token (kept) or at
its own limit (`limit_B`, per-request limits as servers have). Pages: `jaxrl.rollout.pages`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.models import PagedKV, Transformer
from jaxrl.rollout.pages import FreePages, PoolLayout, give_back, own_pages, take
from jaxrl.rollout.sampler import prefill as dense_prefill
from jaxrl.rollout.sampler import sample_rows
from jaxrl.rollout.sampling import SamplingParams

Batching = Literal["continuous", "static"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and pages (the static part of one rollout call)."""

    max_slots: int | None = None  # None: every row at once
    page_size: int = 16
    batching: Batching = "continuous"
    attention: Literal["auto", "xla", "pallas"] = "auto"
    pages_per_block: int = 8
    row_pages: int | None = None  # None: every slot's worst case fits at once
    min_slots: int | None = None  # None: the slot count stays; else it halves down to this

    def __post_init__(self):
        if self.max_slots is not None and self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1 or None, got {self.max_slots}")
        if self.min_slots is not None and self.min_slots < 2:
            raise ValueError(f"min_slots must be >= 2 or None, got {self.min_slots}")
        if self.min_slots is not None and self.batching == "static":
            raise ValueError(f"min_slots={self.min_slots} shrinks continuous batching's "
                             f"slots; with batching=static expected None")
        if self.attention not in ("auto", "xla", "pallas"):
            raise ValueError(f"attention must be 'auto', 'xla' or 'pallas', got "
                             f"{self.attention!r}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")


@struct.dataclass
class Prefix:
    """What `prefill_group` leaves for `insert`: per prompt its length; per row its first
    token (sampled from the prompt's last logits; it and its log-probs are already in the
    state's outputs) and whether the row already ended on it."""

    prompt_len_P: jax.Array
    first_token_B: jax.Array
    done_B: jax.Array


@struct.dataclass
class DecodeState:
    """The pool, the slots, and the rows' outputs ([B, C], filled as tokens are drawn)."""

    kv_pages: jax.Array  # [layers, pages, page_size, 2 * kv_heads, head_dim]
    free: FreePages
    row_S: jax.Array  # the row a slot decodes (-1: free)
    t_S: jax.Array  # tokens the row has drawn
    token_S: jax.Array  # its last token (fed next)
    page_table_SxM: jax.Array
    tokens_BxC: jax.Array
    mask_BxC: jax.Array
    logp_BxC: jax.Array
    logp_raw_BxC: jax.Array

    @property
    def live_S(self) -> jax.Array:
        return self.row_S >= 0


def init_decode_state(model: Transformer, layout: PoolLayout, num_slots: int, num_rows: int,
                      max_new_tokens: int, pad_token_id: int) -> DecodeState:
    """An empty pool and free slots for `num_rows` rows of up to `max_new_tokens` tokens."""
    cfg = model.config
    shape = (cfg.num_layers, layout.num_pages, layout.page_size, 2 * cfg.num_kv_heads,
             cfg.head_dim)
    b, c = num_rows, max_new_tokens
    return DecodeState(
        kv_pages=jnp.zeros(shape, cfg.compute_dtype), free=FreePages.full(layout),
        row_S=jnp.full((num_slots,), -1, jnp.int32), t_S=jnp.zeros((num_slots,), jnp.int32),
        token_S=jnp.zeros((num_slots,), jnp.int32),
        page_table_SxM=jnp.full((num_slots, layout.table_width), -1, jnp.int32),
        tokens_BxC=jnp.full((b, c), pad_token_id, jnp.int32), mask_BxC=jnp.zeros((b, c), bool),
        logp_BxC=jnp.zeros((b, c), jnp.float32), logp_raw_BxC=jnp.zeros((b, c), jnp.float32))


def pool_kv(cache) -> jax.Array:
    """A dense cache's keys and values ([layers, B, T, K, H] each) interleaved on the head
    axis as the page pool holds them: [layers, B, T, 2K, H] (k, v of head 0, then head 1...)."""
    return jnp.stack([cache.k, cache.v], axis=4).reshape(
        *cache.k.shape[:3], -1, cache.k.shape[-1])


def prefill_group(model: Transformer, state: DecodeState, layout: PoolLayout,
                  prompt_ids_PxL: jax.Array, prompt_mask_PxL: jax.Array, row_keys_B: jax.Array,
                  limit_B: jax.Array, stop_ids: jax.Array, sampling: SamplingParams,
                  ) -> tuple[DecodeState, Prefix]:
    """Left-padded prompts through the model once; their real tokens' k/v into the prompt
    pages; the first token of each of the G = B / P samples of every prompt (as JetStream's
    `prefill_multisampling`)."""
    num_prompts = prompt_ids_PxL.shape[0]
    g = row_keys_B.shape[0] // num_prompts
    mask_PxL = prompt_mask_PxL.astype(bool)
    # The dense sampler's prefill into a cache of just the prompt (no new-token slots).
    logits_PxV, cache, _ = dense_prefill(model, prompt_ids_PxL, mask_PxL, 1)
    # Real token i of prompt p (left padding skipped) goes to page p * Mp + i // T, offset i % T.
    n_P = jnp.sum(mask_PxL, axis=1, dtype=jnp.int32)
    index_PxL = jnp.cumsum(mask_PxL, axis=1, dtype=jnp.int32) - 1
    page_PxL = jnp.arange(num_prompts)[:, None] * layout.prompt_pages + index_PxL // layout.page_size
    page_PxL = jnp.where(mask_PxL, page_PxL, layout.num_pages)  # padding: dropped
    kv_LxPxLx2KxH = pool_kv(cache)
    kv_pages = state.kv_pages.at[:, page_PxL, index_PxL % layout.page_size].set(
        kv_LxPxLx2KxH.astype(state.kv_pages.dtype), mode="drop")
    logits_BxV = jnp.repeat(logits_PxV, g, axis=0)
    keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys_B, 0)
    token_B, logp_B, logp_raw_B = sample_rows(keys_B, logits_BxV, sampling)
    done_B = jnp.isin(token_B, stop_ids) | (limit_B <= 1)
    state = state.replace(
        kv_pages=kv_pages, tokens_BxC=state.tokens_BxC.at[:, 0].set(token_B),
        mask_BxC=state.mask_BxC.at[:, 0].set(True), logp_BxC=state.logp_BxC.at[:, 0].set(logp_B),
        logp_raw_BxC=state.logp_raw_BxC.at[:, 0].set(logp_raw_B))
    return state, Prefix(n_P, token_B, done_B)


def prefill(model: Transformer, state: DecodeState, layout: PoolLayout,
            prompt_ids_PxL: jax.Array, prompt_mask_PxL: jax.Array, keys_P: jax.Array,
            limit_P: jax.Array, stop_ids: jax.Array, sampling: SamplingParams,
            ) -> tuple[DecodeState, Prefix]:
    """One sample per prompt (row p is prompt p): `prefill_group` with G = 1."""
    return prefill_group(model, state, layout, prompt_ids_PxL, prompt_mask_PxL, keys_P,
                         limit_P, stop_ids, sampling)


def insert(state: DecodeState, prefix: Prefix, layout: PoolLayout, slot_row_S: jax.Array,
           limit_B: jax.Array, group_size: int) -> DecodeState:
    """Starts row slot_row_S[s] in every slot s where it is >= 0 (the slot must be free and
    the free stack must hold the rows' pages: `admit` decides both)."""
    start_S = slot_row_S >= 0
    row_S = jnp.maximum(slot_row_S, 0)
    p_S = row_S // group_size
    n_S = prefix.prompt_len_P[p_S]
    t = layout.page_size
    need_S = jnp.where(start_S, own_pages(n_S, limit_B[row_S], t), 0)
    free, own_SxM = take(state.free, need_S, layout.table_width)
    j_M = jnp.arange(layout.table_width)
    full_S = n_S // t
    shared_SxM = p_S[:, None] * layout.prompt_pages + j_M[None, :]
    own_index_SxM = jnp.clip(j_M[None, :] - full_S[:, None], 0, layout.table_width - 1)
    table_SxM = jnp.where(j_M[None, :] < full_S[:, None], shared_SxM,
                          jnp.take_along_axis(own_SxM, own_index_SxM, axis=1))
    table_SxM = jnp.where(j_M[None, :] < (full_S + need_S)[:, None], table_SxM, -1)
    # The partial last prompt page, copied into the row's first own page (all layers).
    copy_S = start_S & (n_S % t != 0) & (need_S > 0)
    src_S = p_S * layout.prompt_pages + full_S
    dst_S = jnp.where(copy_S, own_SxM[:, 0], layout.num_pages)
    kv_pages = state.kv_pages.at[:, dst_S].set(state.kv_pages[:, src_S], mode="drop")
    return state.replace(
        kv_pages=kv_pages, free=free,
        row_S=jnp.where(start_S, slot_row_S, state.row_S),
        t_S=jnp.where(start_S, 1, state.t_S),
        token_S=jnp.where(start_S, prefix.first_token_B[row_S], state.token_S),
        page_table_SxM=jnp.where(start_S[:, None], table_SxM, state.page_table_SxM))


def generate(model: Transformer, state: DecodeState, prefix: Prefix, layout: PoolLayout,
             config: EngineConfig, row_keys_B: jax.Array, limit_B: jax.Array,
             stop_ids: jax.Array, group_size: int, sampling: SamplingParams,
             ) -> tuple[DecodeState, jax.Array]:
    """(state, token_S): one token for every live slot (-1 for a free one), also written to
    its row's outputs; rows that end give their slot and pages back."""
    live_S = state.live_S
    row_S = jnp.maximum(state.row_S, 0)
    n_S = prefix.prompt_len_P[row_S // group_size]
    pos_S = n_S + state.t_S - 1  # position of the token fed now
    t = layout.page_size
    column_S = jnp.clip(pos_S // t, 0, layout.table_width - 1)  # free slots: anything
    page_S = jnp.take_along_axis(state.page_table_SxM, column_S[:, None], axis=1)[:, 0]
    paged = PagedKV(state.kv_pages, state.page_table_SxM, jnp.where(live_S, pos_S + 1, 0),
                    jnp.where(live_S, page_S, -1), pos_S % t, impl=config.attention,
                    pages_per_block=config.pages_per_block)
    logits_SxV, kv_pages = model.decode_paged(state.token_S, pos_S, paged)
    keys_S = jax.vmap(jax.random.fold_in)(row_keys_B[row_S], state.t_S)
    token_S, logp_S, logp_raw_S = sample_rows(keys_S, logits_SxV, sampling)
    b = state.tokens_BxC.shape[0]
    out_row_S = jnp.where(live_S, row_S, b)  # free slots write nothing
    col_S = state.t_S
    t_S = state.t_S + 1
    ended_S = live_S & (jnp.isin(token_S, stop_ids) | (t_S >= limit_B[row_S]))
    own_SxM = jnp.where(
        ended_S[:, None] & (jnp.arange(layout.table_width)[None, :] >= (n_S // t)[:, None]),
        state.page_table_SxM, -1)
    return state.replace(
        kv_pages=kv_pages, free=give_back(state.free, own_SxM),
        row_S=jnp.where(ended_S, -1, state.row_S), t_S=t_S, token_S=token_S,
        page_table_SxM=jnp.where(ended_S[:, None], -1, state.page_table_SxM),
        tokens_BxC=state.tokens_BxC.at[out_row_S, col_S].set(token_S, mode="drop"),
        mask_BxC=state.mask_BxC.at[out_row_S, col_S].set(True, mode="drop"),
        logp_BxC=state.logp_BxC.at[out_row_S, col_S].set(logp_S, mode="drop"),
        logp_raw_BxC=state.logp_raw_BxC.at[out_row_S, col_S].set(logp_raw_S, mode="drop")
    ), jnp.where(live_S, token_S, -1)


def admit(state: DecodeState, prefix: Prefix, layout: PoolLayout, queue_B: jax.Array,
          num_queued: jax.Array, next_: jax.Array, limit_B: jax.Array, group_size: int,
          batching: Batching) -> tuple[jax.Array, jax.Array]:
    """(slot_row_S, next'): the next queued rows for the free slots, in queue order, as many
    as there are free slots and free pages for (static batching: only when all are free)."""
    num_slots = state.row_S.shape[0]
    free_S = ~state.live_S
    if batching == "static":
        free_S &= ~jnp.any(state.live_S)
    rank_S = jnp.cumsum(free_S) - 1  # the k-th free slot takes the k-th candidate
    cand_K = jnp.clip(next_ + jnp.arange(num_slots), 0, queue_B.shape[0] - 1)
    row_K = queue_B[cand_K]
    need_K = own_pages(prefix.prompt_len_P[row_K // group_size], limit_B[row_K], layout.page_size)
    ok_K = (next_ + jnp.arange(num_slots) < num_queued) & (
        jnp.cumsum(need_K) <= state.free.count) & (jnp.arange(num_slots) < jnp.sum(free_S))
    ok_K = jnp.cumprod(ok_K).astype(bool)  # a prefix: rows start in queue order
    k = jnp.sum(ok_K, dtype=jnp.int32)
    rank_S = jnp.clip(rank_S, 0, num_slots - 1)
    slot_row_S = jnp.where(free_S & (rank_S < k), row_K[rank_S], -1)
    return slot_row_S, next_ + k


def max_concurrent_decodes(config: EngineConfig, num_rows: int) -> int:
    """The decode slots of a rollout of `num_rows` rows: `max_slots` (None: every row), at
    most the rows, at least 2: with one row XLA's dots take their matrix-vector path, which
    rounds differently (measured on CPU: 2e-6 in log-probs); from 2 slots up a row's numbers
    do not depend on the slot count, and a spare slot just stays free."""
    return max(2, num_rows if config.max_slots is None else min(config.max_slots, num_rows))


def slot_tiers(num_slots: int, min_slots: int | None) -> tuple[int, ...]:
    """The slot counts the loop runs with: `num_slots`, then halves while >= `min_slots`."""
    tiers = [num_slots]
    while min_slots is not None and tiers[-1] // 2 >= max(min_slots, 2):
        tiers.append(tiers[-1] // 2)
    return tuple(tiers)


def shrink(state: DecodeState, num_slots: int) -> DecodeState:
    """The live slots (at most `num_slots`) moved into the first `num_slots` slots: a row
    keeps its pages, position and key, so its tokens do not change."""
    keep_S = jnp.argsort(~state.live_S, stable=True)[:num_slots]
    return state.replace(row_S=state.row_S[keep_S], t_S=state.t_S[keep_S],
                         token_S=state.token_S[keep_S],
                         page_table_SxM=state.page_table_SxM[keep_S])


def resolve_attention(attention: str, model_config, layout: PoolLayout, num_slots: int) -> str:
    """`auto`: the TPU kernel on TPU when its static checks take these shapes, else XLA."""
    if attention != "auto":
        return attention
    if jax.default_backend() != "tpu":
        return "xla"
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import static_validate_inputs

    from jaxrl.models.paged_attention import pallas_arguments

    c = model_config
    q = jax.ShapeDtypeStruct((num_slots, c.num_heads, c.head_dim), c.compute_dtype)
    kv = jax.ShapeDtypeStruct((layout.num_pages, layout.page_size, 2 * c.num_kv_heads,
                               c.head_dim), c.compute_dtype)
    table = jax.ShapeDtypeStruct((num_slots, layout.table_width), jnp.int32)
    try:
        args = jax.eval_shape(pallas_arguments, q, kv, table,
                              jax.ShapeDtypeStruct((num_slots,), jnp.int32))
        static_validate_inputs(*args, sm_scale=c.head_dim ** -0.5,
                               sliding_window=c.sliding_window)
    except (ValueError, NotImplementedError):
        return "xla"
    return "pallas"
