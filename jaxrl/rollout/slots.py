"""The rollout engine: decode slots over one paged KV pool. Every rollout runs on it.

JetStream's engine shape, pure JAX, each op traceable into a larger compiled program:

    prefix        = prefill(model, ids_PxL, mask_PxL)       left-padded prompts through the
                                                            model once: k/v by position, and
                                                            the logits of their last token
    first         = first_tokens(logits_BxV, keys_B, ...)   each row's token 0
    state         = init(model_config, layout, num_slots)   every slot free, every page free
    state         = write_prompts(state, layout, kv, n_P, home_P)   prompt k/v into home pages
    state         = insert(state, layout, starts, stops)    rows start in slots
    state, drawn  = generate(model, state, layout, ...)     one token for every live slot
    state         = extend(model, state, layout, slot, ids_W, n, ...)   a chunk appended to a
                                                            slot (multi-turn: an observation)
    state, sent   = take_pending(state)                     the tokens drawn since last taken

Three drivers run these ops: the RL loop (`jaxrl.rollout.decode_loop`, with its in-flight
pieces), a server (`jaxrl.rollout.serving`, wrapped as JetStream's Engine in `jaxrl.serve`)
and the multi-turn host loop (`jaxrl.step.multiturn_rollout`).

The one token order. A slot holds the last token it drew (`token_S`, with its log-probs),
which it has not fed yet; `generate` feeds it at `pos_S` and draws the next. Its completion
index is `pos_S - base_S` (base: the prompt's length), and it is drawn with
fold_in(key, index), so a row's tokens depend on neither its slot nor the other rows. A
drawn token ends the slot's *row* if it is one of `Stops.row_ids` or the row's `limit_S`-th
completion token (the row's pages go back to the free stack at once: the device knows), and
ends the slot's *turn* if, besides, it is one of `Stops.turn_ids` or the turn's
`Stops.turn_tokens`-th: the slot stops decoding (`live_S` 0) and its last token is never fed,
unless `extend` later feeds it with what follows. The RL loop writes each token where it is
drawn; a server and the multi-turn loop read them with `take_pending`, one call later (a
request's first token is drawn by prefill, but JetStream 0.2.2 can only emit tokens from
`generate`).

Pages (`jaxrl.rollout.pages`): a prompt is written once into its *home* pages (RL: one home
per prompt of the call, shared by its G samples; a server or the multi-turn loop: one home per
slot); a row's table points at its home's full pages, and at its own pages, taken from the
free stack at insertion for its worst case (a partial last prompt page is copied into the
first). Inserting into a slot first gives back the pages it still held.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.models import KVCache, PagedKV, Transformer, default_positions
from jaxrl.rollout.pages import FreePages, PoolLayout, give_back, own_pages, take
from jaxrl.rollout.sampling import sample_rows
from jaxrl.rollout.settings import PagedAttentionSettings, SamplingParams
from jaxrl.sharding import constrain

# The pool's logical axes: its KV heads split as the model's attention reads them.
KV_AXES = ("layers", None, None, "act_kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class Stops:
    """What ends a row (`row_ids`) and, besides, a turn (`turn_ids`, the turn's
    `turn_tokens`-th token). RL and serving: rows only (a turn is the whole row)."""

    row_ids: tuple[int, ...] = ()
    turn_ids: tuple[int, ...] = ()
    turn_tokens: int | None = None

    def ends(self, token_S, index_S, turn_S, limit_S) -> tuple[jax.Array, jax.Array]:
        """(row_end_S, turn_end_S) of tokens drawn at completion `index_S`, the `turn_S`-th of
        their turn, in rows capped at `limit_S` tokens."""
        row_end = _isin(token_S, self.row_ids) | (index_S + 1 >= limit_S)
        turn_end = row_end | _isin(token_S, self.turn_ids)
        if self.turn_tokens is not None:
            turn_end |= turn_S >= self.turn_tokens
        return row_end, turn_end


def _isin(token_S, ids):
    return jnp.isin(token_S, jnp.asarray(ids, jnp.int32)) if ids else jnp.zeros_like(token_S, bool)


@struct.dataclass
class SlotState:
    """The pool and, per slot: its row (-1: free), whether it decodes (`live_S`), its last
    drawn token, not fed yet, with its log-probs (as sampled, and at temperature 1), whether
    `take_pending` has read that token (`unsent_S`), the position it is fed at, the prompt's
    length, the row's cap on completion tokens, the tokens of the current turn, and the row's
    key (raw key data, so the state is arrays only)."""

    kv_pages: jax.Array  # [layers, pages, page_size, 2 * kv_heads, head_dim]
    free: FreePages
    page_table_SxM: jax.Array
    row_S: jax.Array
    live_S: jax.Array
    unsent_S: jax.Array
    token_S: jax.Array
    logp_S: jax.Array
    logp_raw_S: jax.Array
    pos_S: jax.Array
    base_S: jax.Array
    limit_S: jax.Array
    turn_S: jax.Array
    key_SxK: jax.Array


@struct.dataclass
class Prefix:
    """Prompts after `prefill`: k/v by position ([layers, P, L, 2K, H]; position j of prompt
    p at [:, p, j], past its length unused), lengths, and the logits of the last token."""

    kv_LxPxLx2KxH: jax.Array
    length_P: jax.Array
    logits_PxV: jax.Array


@struct.dataclass
class Starts:
    """Rows to start, per slot (`row_S` -1: the slot is left as it is): the home of the
    row's prompt, its length, its first token and log-probs, key (raw data) and limit."""

    row_S: jax.Array
    home_S: jax.Array
    length_S: jax.Array
    token_S: jax.Array
    logp_S: jax.Array
    logp_raw_S: jax.Array
    key_SxK: jax.Array
    limit_S: jax.Array


@struct.dataclass
class Drawn:
    """What `generate` drew for each slot: its row (-1: the slot was not live), the token,
    its completion index and log-probs, and whether it ended the row / the turn."""

    row_S: jax.Array
    token_S: jax.Array
    index_S: jax.Array
    logp_S: jax.Array
    logp_raw_S: jax.Array
    row_end_S: jax.Array
    turn_end_S: jax.Array


@struct.dataclass
class Sent:
    """What `take_pending` read: per slot the token (valid where `valid_S`), its completion
    index and log-probs, and whether it ended its turn."""

    token_S: jax.Array
    valid_S: jax.Array
    index_S: jax.Array
    logp_S: jax.Array
    logp_raw_S: jax.Array
    ended_S: jax.Array


def init(model_config, layout: PoolLayout, num_slots: int) -> SlotState:
    """An empty pool and `num_slots` free slots."""
    c, s = model_config, num_slots
    shape = (c.num_layers, layout.num_pages, layout.page_size, 2 * c.num_kv_heads, c.head_dim)
    # Separate buffers, not one array several times: the drivers donate the state.
    ints = [jnp.zeros((s,), jnp.int32) for _ in range(5)]
    key_data = jax.random.key_data(jax.random.key(0))
    # KV heads split over `tensor` where the rules do (the model's attention reads them so).
    kv_pages = constrain(jnp.zeros(shape, c.compute_dtype), KV_AXES)
    return SlotState(
        kv_pages=kv_pages, free=FreePages.full(layout),
        page_table_SxM=jnp.full((s, layout.table_width), -1, jnp.int32),
        row_S=jnp.full((s,), -1, jnp.int32), live_S=jnp.zeros((s,), bool),
        unsent_S=jnp.zeros((s,), bool), token_S=ints[0], logp_S=jnp.zeros((s,), jnp.float32),
        logp_raw_S=jnp.zeros((s,), jnp.float32), pos_S=ints[1], base_S=ints[2],
        limit_S=ints[3], turn_S=ints[4],
        key_SxK=jnp.zeros((s, *key_data.shape), key_data.dtype))


def pool_kv(cache: KVCache) -> jax.Array:
    """A dense cache's keys and values ([layers, B, T, K, H] each) interleaved on the head
    axis as the page pool holds them: [layers, B, T, 2K, H] (k, v of head 0, then head 1...)."""
    return jnp.stack([cache.k, cache.v], axis=4).reshape(
        *cache.k.shape[:3], -1, cache.k.shape[-1])


def prefill(model: Transformer, ids_PxL: jax.Array, mask_PxL: jax.Array) -> Prefix:
    """Left-padded prompts through the model once, into a cache of just the prompts."""
    num_prompts, width = ids_PxL.shape
    mask_PxL = mask_PxL.astype(bool)
    cache = KVCache.init(model.config, num_prompts, width)
    logits_Px1xV, cache = model.extend(ids_PxL, default_positions(mask_PxL), cache, mask_PxL,
                                       last_only=True)
    length_P = jnp.sum(mask_PxL, axis=1, dtype=jnp.int32)
    # Position j of prompt p sits at column width - n_p + j of the left-padded cache.
    column_PxL = jnp.clip(width - length_P[:, None] + jnp.arange(width)[None], 0, width - 1)
    kv = jnp.take_along_axis(pool_kv(cache), column_PxL[None, :, :, None, None], axis=2)
    return Prefix(kv, length_P, logits_Px1xV[:, 0])


def first_tokens(logits_BxV: jax.Array, key_BxK: jax.Array, sampling: SamplingParams
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token_B, logp_B, logp_raw_B): each row's token 0, drawn with fold_in(key, 0)."""
    keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
        jax.random.wrap_key_data(key_BxK), 0)
    return sample_rows(keys_B, logits_BxV, sampling)


def one_row(prefix: Prefix, key_K: jax.Array, limit, sampling: SamplingParams) -> Starts:
    """A row of a one-prompt `prefix` (its key's raw data, its cap on new tokens), its first
    token drawn: what a server and the multi-turn loop give `insert_home`."""
    token_1, logp_1, logp_raw_1 = first_tokens(prefix.logits_PxV, key_K[None], sampling)
    zero = jnp.zeros((1,), jnp.int32)
    return Starts(zero, zero, prefix.length_P, token_1, logp_1, logp_raw_1, key_K[None],
                  jnp.full((1,), limit, jnp.int32))


def write_prompts(state: SlotState, layout: PoolLayout, kv_LxPxLx2KxH: jax.Array,
                  length_P: jax.Array, home_P: jax.Array) -> SlotState:
    """Prompt p's k/v (by position, its first length_P[p]) into the pages of home home_P[p]:
    position j at page home * Mp + j // T, offset j % T."""
    width = kv_LxPxLx2KxH.shape[2]
    j_L = jnp.arange(width)
    page_PxL = home_P[:, None] * layout.prompt_pages + j_L[None] // layout.page_size
    page_PxL = jnp.where(j_L[None] < length_P[:, None], page_PxL, layout.num_pages)  # dropped
    offset_PxL = jnp.broadcast_to(j_L % layout.page_size, page_PxL.shape)
    kv_pages = state.kv_pages.at[:, page_PxL, offset_PxL].set(
        kv_LxPxLx2KxH.astype(state.kv_pages.dtype), mode="drop")
    return state.replace(kv_pages=kv_pages)


def insert_home(state: SlotState, layout: PoolLayout, prefix: Prefix, row: Starts,
                slot: jax.Array, stops: Stops) -> SlotState:
    """One row (`prefix` and `row` of one prompt) into `slot`, its prompt written into the
    slot's home pages: how a server and the multi-turn loop start a row."""
    width = prefix.kv_LxPxLx2KxH.shape[2]
    if width > layout.prompt_pages * layout.page_size:
        raise ValueError(f"a prompt of {width} tokens is longer than the pool's "
                         f"{layout.prompt_pages * layout.page_size} prompt positions")
    slot = jnp.asarray(slot, jnp.int32)
    state = write_prompts(state, layout, prefix.kv_LxPxLx2KxH, prefix.length_P, slot[None])
    num_slots = state.row_S.shape[0]
    starts = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_slots, *x.shape[1:])), row)
    starts = starts.replace(row_S=jnp.where(jnp.arange(num_slots) == slot, row.row_S[0], -1),
                            home_S=jnp.full((num_slots,), slot, jnp.int32))
    return insert(state, layout, starts, stops)


def _own_columns(table_SxM, base_S, page_size):
    """The page-table entries of each slot's own pages (its home's full pages are shared)."""
    j_M = jnp.arange(table_SxM.shape[1])
    return jnp.where(j_M[None] >= (base_S // page_size)[:, None], table_SxM, -1)


def insert(state: SlotState, layout: PoolLayout, starts: Starts, stops: Stops) -> SlotState:
    """Starts row starts.row_S[s] in every slot s where it is >= 0: the slot's old pages go
    back to the stack, the row takes its own (the caller checked they fit), and its first
    token may already end it (then the slot holds it, unsent, and does not decode)."""
    start_S = starts.row_S >= 0
    t = layout.page_size
    free = give_back(state.free, jnp.where(
        start_S[:, None], _own_columns(state.page_table_SxM, state.base_S, t), -1))
    n_S, home_S = starts.length_S, starts.home_S
    row_end_S, turn_end_S = stops.ends(starts.token_S, 0, 1, starts.limit_S)
    need_S = jnp.where(start_S & ~row_end_S, own_pages(n_S, starts.limit_S, t), 0)
    free, own_SxM = take(free, need_S, layout.table_width)
    j_M = jnp.arange(layout.table_width)
    full_S = n_S // t
    shared_SxM = home_S[:, None] * layout.prompt_pages + j_M[None, :]
    own_index_SxM = jnp.clip(j_M[None, :] - full_S[:, None], 0, layout.table_width - 1)
    table_SxM = jnp.where(j_M[None, :] < full_S[:, None], shared_SxM,
                          jnp.take_along_axis(own_SxM, own_index_SxM, axis=1))
    table_SxM = jnp.where(j_M[None, :] < (full_S + need_S)[:, None], table_SxM, -1)
    # The partial last prompt page, copied into the row's first own page (all layers).
    copy_S = (n_S % t != 0) & (need_S > 0)
    src_S = home_S * layout.prompt_pages + full_S
    dst_S = jnp.where(copy_S, own_SxM[:, 0], layout.num_pages)
    kv_pages = state.kv_pages.at[:, dst_S].set(state.kv_pages[:, src_S], mode="drop")

    def put(new, old):
        return jnp.where(start_S.reshape(-1, *(1,) * (old.ndim - 1)), new, old)

    return state.replace(
        kv_pages=kv_pages, free=free, page_table_SxM=put(table_SxM, state.page_table_SxM),
        row_S=put(jnp.where(row_end_S, -1, starts.row_S), state.row_S),
        live_S=put(~turn_end_S, state.live_S), unsent_S=put(True, state.unsent_S),
        token_S=put(starts.token_S, state.token_S), logp_S=put(starts.logp_S, state.logp_S),
        logp_raw_S=put(starts.logp_raw_S, state.logp_raw_S), pos_S=put(n_S, state.pos_S),
        base_S=put(n_S, state.base_S), limit_S=put(starts.limit_S, state.limit_S),
        turn_S=put(1, state.turn_S), key_SxK=put(starts.key_SxK, state.key_SxK))


def _drew(state: SlotState, layout: PoolLayout, drew_S, token_S, logp_S, logp_raw_S, pos_S,
          turn_S, stops: Stops) -> tuple[SlotState, jax.Array, jax.Array]:
    """The state after slots `drew_S` drew `token_S` for position `pos_S` (its index: pos -
    base): a row that ended gives its own pages back, a turn that ended stops decoding."""
    row_end_S, turn_end_S = stops.ends(token_S, pos_S - state.base_S, turn_S, state.limit_S)
    row_end_S &= drew_S
    turn_end_S &= drew_S
    own_SxM = jnp.where(row_end_S[:, None],
                        _own_columns(state.page_table_SxM, state.base_S, layout.page_size), -1)

    def put(new, old):
        return jnp.where(drew_S, new, old)

    return state.replace(
        free=give_back(state.free, own_SxM),
        page_table_SxM=jnp.where(row_end_S[:, None], -1, state.page_table_SxM),
        row_S=jnp.where(row_end_S, -1, state.row_S),
        live_S=jnp.where(drew_S, ~turn_end_S, state.live_S), unsent_S=state.unsent_S | drew_S,
        token_S=put(token_S, state.token_S), logp_S=put(logp_S, state.logp_S),
        logp_raw_S=put(logp_raw_S, state.logp_raw_S), pos_S=put(pos_S, state.pos_S),
        turn_S=put(turn_S, state.turn_S)), row_end_S, turn_end_S


def _draw(state: SlotState, logits_SxV, index_S, sampling):
    keys_S = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state.key_SxK), index_S)
    return sample_rows(keys_S, logits_SxV, sampling)


def generate(model: Transformer, state: SlotState, layout: PoolLayout,
             attention: PagedAttentionSettings, stops: Stops, sampling: SamplingParams
             ) -> tuple[SlotState, Drawn]:
    """Every live slot feeds its token at its position, attending over its own pages only,
    and draws the next (free slots compute nothing that is kept)."""
    live_S, pos_S, t = state.live_S, state.pos_S, layout.page_size
    column_S = jnp.clip(pos_S // t, 0, layout.table_width - 1)
    page_S = jnp.take_along_axis(state.page_table_SxM, column_S[:, None], axis=1)[:, 0]
    paged = PagedKV(state.kv_pages, state.page_table_SxM, jnp.where(live_S, pos_S + 1, 0),
                    jnp.where(live_S, page_S, -1), pos_S % t, impl=attention.impl,
                    pages_per_block=attention.pages_per_block, unroll=attention.unroll)
    logits_SxV, kv_pages = model.decode_paged(state.token_S, pos_S, paged)
    index_S = pos_S + 1 - state.base_S
    token_S, logp_S, logp_raw_S = _draw(state, logits_SxV, index_S, sampling)
    row_S = jnp.where(live_S, state.row_S, -1)
    state, row_end_S, turn_end_S = _drew(state.replace(kv_pages=kv_pages), layout, live_S,
                                         token_S, logp_S, logp_raw_S, pos_S + 1,
                                         state.turn_S + 1, stops)
    return state, Drawn(row_S, token_S, index_S, logp_S, logp_raw_S, row_end_S, turn_end_S)


def extend(model: Transformer, state: SlotState, layout: PoolLayout, slot: jax.Array,
           ids_W: jax.Array, n: jax.Array, last: jax.Array, stops: Stops,
           sampling: SamplingParams) -> tuple[SlotState, jax.Array]:
    """(state, the chunk's last logits): the slot's next `n` tokens (`ids_W[:n]`: its unfed last token, then what follows it,
    e.g. an observation) fed at its position as one chunk over its earlier positions; with
    `last`, the token after them is drawn: a new turn (a long chunk takes several calls).

    The slot's pages are gathered into a dense one-row `KVCache` (valid below its position),
    the model's cached `extend` runs on the chunk, and the chunk's keys/values are scattered
    back into the slot's pages (padding columns write nothing)."""
    width, t, m = ids_W.shape[0], layout.page_size, layout.table_width
    pos = state.pos_S[slot]
    table_M = state.page_table_SxM[slot]
    layers, _, _, kk, h = state.kv_pages.shape
    kv_Lx1xSxKx2xH = state.kv_pages[:, table_M].reshape(layers, 1, m * t, kk // 2, 2, h)
    room = jnp.zeros((layers, 1, width, kk // 2, h), state.kv_pages.dtype)  # never clamps
    k, v = (jnp.concatenate([kv_Lx1xSxKx2xH[..., i, :], room], axis=2) for i in (0, 1))
    valid_1xS = (jnp.arange(m * t + width) < pos)[None]
    real_W = jnp.arange(width) < n
    p_W = pos + jnp.arange(width)
    logits_1xWxV, cache = model.extend(ids_W[None], p_W[None], KVCache(k, v, valid_1xS, pos),
                                       real_W[None])
    new_LxWx2KxH = pool_kv(cache)[:, 0, p_W]
    page_W = jnp.where(real_W, table_M[jnp.clip(p_W // t, 0, m - 1)], layout.num_pages)
    kv_pages = state.kv_pages.at[:, page_W, p_W % t].set(
        new_LxWx2KxH.astype(state.kv_pages.dtype), mode="drop")
    one_S = jnp.arange(state.row_S.shape[0]) == slot
    key = jax.random.wrap_key_data(state.key_SxK[slot])
    token_1, logp_1, logp_raw_1 = sample_rows(
        jax.random.fold_in(key, pos + n - state.base_S[slot])[None], logits_1xWxV[:, n - 1],
        sampling)
    s = one_S.shape[0]
    state = state.replace(kv_pages=kv_pages, pos_S=jnp.where(one_S, pos + n, state.pos_S))
    state = _drew(state, layout, one_S & last,
                  *(jnp.broadcast_to(x, (s,)) for x in (token_1, logp_1, logp_raw_1)),
                  jnp.full((s,), pos + n, jnp.int32), jnp.ones((s,), jnp.int32), stops)[0]
    return state, logits_1xWxV[0, n - 1]


def take_pending(state: SlotState) -> tuple[SlotState, Sent]:
    """The tokens drawn since the last call (by insert, generate or extend), one per slot."""
    sent = Sent(state.token_S, state.unsent_S, state.pos_S - state.base_S, state.logp_S,
                state.logp_raw_S, state.unsent_S & ~state.live_S)
    return state.replace(unsent_S=jnp.zeros_like(state.unsent_S)), sent


def shrink(state: SlotState, num_slots: int) -> SlotState:
    """The live slots (at most `num_slots`) moved into the first `num_slots` slots: a row
    keeps its pages, position and key, so its tokens do not change (RL: a free slot holds
    nothing)."""
    keep_S = jnp.argsort(~state.live_S, stable=True)[:num_slots]
    return state.replace(**{f.name: getattr(state, f.name)[keep_S]
                            for f in dataclasses.fields(state)
                            if f.name not in ("kv_pages", "free")})
