"""The rollout engine one request at a time, as a server drives it (JetStream's Engine calls).

    layout        = ServeLayout(slots, max_prefill_length, max_new_tokens, page_size)
    state         = init_state(model_config, layout, key)     every slot free
    prefix        = prefill(model, ids_L, n, key, ...)         a prompt's keys/values and its
                                                               first token (not yet emitted)
    state         = insert(state, prefix, slot, layout)        the slot starts that request
    state, out_S  = generate(model, state, layout, ...)        per slot: emit its pending
                                                               token, draw the next one

Pure JAX, no JetStream: `jaxrl.serve` wraps these in JetStream's Engine, and they run
under `jit` like the RL step's engine (`jaxrl.rollout.continuous`), with the same model
code (`Transformer.decode_paged`) and sampling (`sample_rows`), so a served greedy
completion is the one `jaxrl generate` prints.

A server learns that a request ended only from what `generate` returned, and gives its slot
to the next request by inserting over it; so, unlike the RL engine's free stack, each slot
owns a fixed run of pages (slot s: pages [s * M, (s + 1) * M), M = ceil((Lp + C - 1) / T)
for prompts up to Lp tokens and C new tokens). Attention still reads only a slot's live
pages.

Each `generate` emits a slot's pending token (drawn by the previous call, or by `prefill`
for the first) and draws the next, so the first token, drawn at prefill, is emitted by the
first `generate` after `insert`, and a request's k-th token is emitted by its k-th call. A
slot stops (`valid` 0 from then on) after emitting a stop token or its C-th token; token t of
a request is drawn with fold_in(key, t), as a row of the RL engine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.models import PagedKV, Transformer
from jaxrl.rollout.continuous import pool_kv
from jaxrl.rollout.sampler import prefill as dense_prefill
from jaxrl.rollout.sampler import sample_rows
from jaxrl.rollout.sampling import SamplingParams

MAX_FIT_SLOTS = 512  # the memory fit's ceiling: beyond, a decode step's latency grows for little


@dataclasses.dataclass(frozen=True)
class ServeLayout:
    """The static shape of a server's pool: `num_slots` slots of `slot_pages` pages of
    `page_size` tokens, for prompts up to `max_prefill_length` and `max_new_tokens` new
    tokens each."""

    num_slots: int
    max_prefill_length: int
    max_new_tokens: int
    page_size: int

    def __post_init__(self):
        for name in ("num_slots", "max_prefill_length", "max_new_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def slot_pages(self) -> int:
        """M: pages of one slot (its prompt and every new token but the last, never fed)."""
        return -(-(self.max_prefill_length + self.max_new_tokens - 1) // self.page_size)

    @property
    def table_width(self) -> int:
        return self.slot_pages

    @property
    def num_pages(self) -> int:
        return self.num_slots * self.slot_pages

    def page_table(self) -> jax.Array:
        """[S, M]: slot s owns pages s * M .. (s + 1) * M - 1."""
        return jnp.arange(self.num_pages, dtype=jnp.int32).reshape(self.num_slots, -1)


def slot_bytes(model_config, max_prefill_length: int, max_new_tokens: int,
               page_size: int) -> int:
    """KV bytes of one slot: its pages x layers x 2 x kv heads x head dim x dtype."""
    c = model_config
    pages = ServeLayout(1, max_prefill_length, max_new_tokens, page_size).slot_pages
    item = jnp.dtype(c.compute_dtype).itemsize
    return pages * page_size * c.num_layers * 2 * c.num_kv_heads * c.head_dim * item


def slots_that_fit(model_config, *, memory_bytes: int, weight_bytes: int,
                   max_prefill_length: int, max_new_tokens: int, page_size: int,
                   fraction: float, cap: int | None = MAX_FIT_SLOTS) -> int:
    """How many slots' KV pages fit in `fraction` of a device's `memory_bytes` beside the
    weights, reserving a tenth of what remains for the programs' temporaries; at most `cap`
    (None: no cap), and 0 when not even one fits."""
    free = fraction * memory_bytes - weight_bytes
    per_slot = slot_bytes(model_config, max_prefill_length, max_new_tokens, page_size)
    fit = int(max(0, 0.9 * free // per_slot))
    return fit if cap is None else min(cap, fit)


@struct.dataclass
class ServePrefix:
    """One prompt after `prefill`: its keys/values by position ([layers, L, 2K, H], rows past
    `length` unused), its length, its first token (pending) and its key."""

    kv_LxTx2KxH: jax.Array
    length: jax.Array
    first_token: jax.Array
    key: jax.Array


@struct.dataclass
class ServeState:
    """The pool and each slot's request: live (decoding), the token it emits next, tokens
    emitted so far, the position that token is fed at, its key."""

    kv_pages: jax.Array  # [layers, pages, page_size, 2 * kv_heads, head_dim]
    live_S: jax.Array
    token_S: jax.Array
    emitted_S: jax.Array
    pos_S: jax.Array
    key_S: jax.Array


@struct.dataclass
class StepTokens:
    """What one `generate` gives each slot: the token emitted, whether it is one (the slot
    was live), and the request's tokens so far counting it."""

    token_S: jax.Array
    valid_S: jax.Array
    length_S: jax.Array


def init_state(model_config, layout: ServeLayout, key: jax.Array) -> ServeState:
    """Every slot free (keys: `key`, replaced at insert)."""
    c, s = model_config, layout.num_slots
    shape = (c.num_layers, layout.num_pages, layout.page_size, 2 * c.num_kv_heads, c.head_dim)
    # Separate buffers, not one array thrice: insert and generate donate the state.
    token_S, emitted_S, pos_S = (jnp.zeros((s,), jnp.int32) for _ in range(3))
    return ServeState(jnp.zeros(shape, c.compute_dtype), jnp.zeros((s,), bool), token_S,
                      emitted_S, pos_S, jnp.broadcast_to(key, (s,)))


def prefill(model: Transformer, ids_L: jax.Array, length: jax.Array, key: jax.Array,
            sampling: SamplingParams) -> ServePrefix:
    """A right-padded prompt (`length` real tokens of `ids_L`) through the model once, as
    the RL engine's prefill runs a left-padded one (the same numbers), and its first token
    drawn with fold_in(key, 0)."""
    width = ids_L.shape[0]
    shift = width - length
    ids_1xL = jnp.roll(ids_L, shift)[None]  # left-padded
    mask_1xL = (jnp.arange(width) >= shift)[None]
    logits_1xV, cache, _ = dense_prefill(model, ids_1xL, mask_1xL, 1)
    # Position j of the prompt sits at column shift + j of the left-padded cache.
    column_L = jnp.clip(shift + jnp.arange(width), 0, width - 1)
    kv_LxTx2KxH = pool_kv(cache)[:, 0, column_L]
    first_1, _, _ = sample_rows(jax.random.fold_in(key, 0)[None], logits_1xV, sampling)
    return ServePrefix(kv_LxTx2KxH, jnp.asarray(length, jnp.int32), first_1[0], key)


def write_prefix(kv_pages: jax.Array, kv_LxTx2KxH: jax.Array, slot: jax.Array,
                 layout: ServeLayout) -> jax.Array:
    """A prompt's keys/values by position into the slot's first pages (the rest of the
    slot's pages keep whatever they held: attention never reads past a slot's length)."""
    width = kv_LxTx2KxH.shape[1]
    if width > layout.max_prefill_length:
        raise ValueError(f"a prefix of {width} tokens is longer than the layout's "
                         f"max_prefill_length {layout.max_prefill_length}")
    j_L = jnp.arange(width)
    page_L = layout.page_table()[slot, j_L // layout.page_size]
    return kv_pages.at[:, page_L, j_L % layout.page_size].set(kv_LxTx2KxH.astype(kv_pages.dtype))


def insert(state: ServeState, prefix: ServePrefix, slot: jax.Array,
           layout: ServeLayout) -> ServeState:
    """The slot starts the prefix's request: its keys/values into the slot's first pages
    (whatever the slot held before is overwritten or never read again)."""
    kv_pages = write_prefix(state.kv_pages, prefix.kv_LxTx2KxH, slot, layout)
    return state.replace(
        kv_pages=kv_pages, live_S=state.live_S.at[slot].set(True),
        token_S=state.token_S.at[slot].set(prefix.first_token),
        emitted_S=state.emitted_S.at[slot].set(0), pos_S=state.pos_S.at[slot].set(prefix.length),
        key_S=state.key_S.at[slot].set(prefix.key))


def generate(model: Transformer, state: ServeState, layout: ServeLayout, stop_ids: jax.Array,
             sampling: SamplingParams, attention: str = "xla",
             pages_per_block: int = 8) -> tuple[ServeState, StepTokens]:
    """Every live slot emits its pending token; those that go on feed it and draw the next
    (with fold_in(key, tokens emitted)); a slot ends on a stop token or its
    `max_new_tokens`-th token."""
    emitted_S = state.emitted_S + 1
    out = StepTokens(state.token_S, state.live_S, emitted_S)
    ended_S = jnp.isin(state.token_S, stop_ids) | (emitted_S >= layout.max_new_tokens)
    go_S = state.live_S & ~ended_S
    t = layout.page_size
    pos_S = state.pos_S
    page_S = jnp.take_along_axis(
        layout.page_table(), jnp.clip(pos_S // t, 0, layout.slot_pages - 1)[:, None], axis=1)[:, 0]
    paged = PagedKV(state.kv_pages, layout.page_table(), jnp.where(go_S, pos_S + 1, 0),
                    jnp.where(go_S, page_S, -1), pos_S % t, impl=attention,
                    pages_per_block=pages_per_block)
    logits_SxV, kv_pages = model.decode_paged(state.token_S, pos_S, paged)
    keys_S = jax.vmap(jax.random.fold_in)(state.key_S, emitted_S)
    next_S, _, _ = sample_rows(keys_S, logits_SxV, sampling)
    return state.replace(
        kv_pages=kv_pages, live_S=go_S, token_S=jnp.where(go_S, next_S, state.token_S),
        emitted_S=jnp.where(go_S, emitted_S, state.emitted_S),
        pos_S=jnp.where(go_S, pos_S + 1, pos_S)), out
