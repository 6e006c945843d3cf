"""Ragged decode attention over a paged KV cache: each slot reads only its own live pages.

The pool of one layer is `kv_pages_PxTx2KxH`: P pages of T = page_size tokens, keys and
values interleaved on the head axis (key head k at 2k, value head k at 2k + 1: the layout of
the TPU kernel `jax.experimental.pallas.ops.tpu.ragged_paged_attention`, so both paths read
the same buffer). Slot s holds tokens 0..n_s - 1 of its row, token i in page
`page_table[s, i // T]` at offset i % T. One decode query per slot:

    out_s = softmax(q_s K_s^T * scale + mask) V_s          K_s, V_s: its n_s cached tokens

The XLA path runs everywhere: a `lax.while_loop` over blocks of `pages_per_block` pages with
an online softmax (running max m, sum l, accumulator a, all float32),

    m' = max(m, max_j x_j)    l' = l e^(m - m') + sum_j e^(x_j - m')    a' = a e^(m - m') + sum_j e^(x_j - m') v_j

that reads only live blocks: the slots, longest first, are cut in chunks of C
(`chunk_slots`), and block i is gathered only for the chunks holding a slot that reaches it.
A free slot (length 0) or a block past a slot's last page is never gathered unless its chunk
holds a slot that needs that block: a step gathers sum_i ceil(live_i / C) C blocks (live_i:
slots reaching block i), not S x the longest slot's blocks (free slots would cost several
times the live KV that way: benchmarks/README.md, "Only live KV read"). Within a chunk,
scores past a slot's length are -inf; a fully masked block changes nothing (exp(-inf) = 0,
the correction exp(m - m) = 1), so a slot's output is the same bits whatever the other
slots' lengths and C. A slot of length 0 gets zeros. `unroll` runs every block for every
chunk in a Python loop instead (the same outputs): the program's work as if every slot
reached the table's last page, loop-free, for XLA's cost analysis (which counts a while body
once; `jaxrl.step.rollout_programs`).
`pallas` calls the TPU kernel (TPU only).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl.sharding.rules import active_rules

PagedAttentionImpl = Literal["xla", "pallas"]


def write_token_kv(kv_pages_LxPxTx2KxH: jax.Array, layer: jax.Array, k_SxKxH: jax.Array,
                   v_SxKxH: jax.Array, page_S: jax.Array, offset_S: jax.Array) -> jax.Array:
    """The pool with slot s's new key/value written at (layer, page_S[s], offset_S[s]).

    A slot whose page is out of range (-1, or >= P) writes nothing (`mode="drop"`): that is
    how dead slots skip the write. One scatter into the stacked pool, so a donated pool is
    updated in place.
    """
    s, k, h = k_SxKxH.shape
    kv_Sx2KxH = jnp.stack([k_SxKxH, v_SxKxH], axis=2).reshape(s, 2 * k, h)
    num_pages = kv_pages_LxPxTx2KxH.shape[1]
    page_S = jnp.where((page_S >= 0) & (page_S < num_pages), page_S, num_pages)
    return kv_pages_LxPxTx2KxH.at[layer, page_S, offset_S].set(
        kv_Sx2KxH.astype(kv_pages_LxPxTx2KxH.dtype), mode="drop")


def ragged_decode_attention(q_SxNxH: jax.Array, kv_pages_LxPxTx2KxH: jax.Array,
                            layer: jax.Array, page_table_SxM: jax.Array, length_S: jax.Array,
                            *, scale: float, sliding_window: int | None = None,
                            pages_per_block: int = 8, impl: PagedAttentionImpl = "xla",
                            slots_per_chunk: int | None = None, unroll: bool = False
                            ) -> jax.Array:
    """out_SxNxH: each slot's query over its first length_S[s] cached tokens (see above);
    `slots_per_chunk`: C of the XLA path (None: `chunk_slots(S)`); `unroll`: every block
    of every chunk, loop-free (see above)."""
    if impl == "pallas":
        return _pallas(q_SxNxH, kv_pages_LxPxTx2KxH[layer], page_table_SxM, length_S,
                       scale=scale, sliding_window=sliding_window,
                       pages_per_block=pages_per_block)
    if impl != "xla":
        raise ValueError(f"attention impl must be 'xla' or 'pallas', got {impl!r}")
    s, n, h = q_SxNxH.shape
    page_size, k = kv_pages_LxPxTx2KxH.shape[2], kv_pages_LxPxTx2KxH.shape[3] // 2
    g = n // k
    max_pages = page_table_SxM.shape[1]
    block = min(pages_per_block, max_pages)
    # Pad the table to whole blocks; padded entries are never read unmasked.
    num_blocks_total = -(-max_pages // block)
    table_SxM = jnp.pad(page_table_SxM, ((0, 0), (0, num_blocks_total * block - max_pages)))
    table_SxM = jnp.clip(table_SxM, 0, kv_pages_LxPxTx2KxH.shape[1] - 1)
    tokens_per_block = block * page_size
    c = min(s, slots_per_chunk or chunk_slots(s))
    order_S, live_I, num_blocks = _block_plan(length_S, tokens_per_block, num_blocks_total)
    # Head-major inside: the dots batch over (kv head, slot), the leading axes of both sides.
    q_KxSxGxH = (q_SxNxH.reshape(s, k, g, h).astype(jnp.float32) * scale).transpose(1, 0, 2, 3)

    heads_split = _kv_heads_split()
    pool_LxPxTxKx2xH = kv_pages_LxPxTx2KxH.reshape(*kv_pages_LxPxTx2KxH.shape[:3], k, 2, h)

    def planes(pages_CxB, which: int):
        """[K, C, J, H]: the keys (`which` 0) or values (1) of the pages_CxB, gathered straight
        into the layout the dots read. With KV heads split over devices (`tensor`) indexing
        the head axis would all-reduce the gathered blocks: there the pages are gathered
        with all their local heads and split by a reshape and a transpose."""
        if heads_split:
            return pool_LxPxTxKx2xH[layer, pages_CxB, :, :, which, :].reshape(
                -1, tokens_per_block, k, h).transpose(2, 0, 1, 3).astype(jnp.float32)
        heads_Kx1x1 = 2 * jnp.arange(k)[:, None, None] + which  # head k's key at 2k, value 2k+1
        return kv_pages_LxPxTx2KxH[layer, pages_CxB[None], :, heads_Kx1x1, :].reshape(
            k, -1, tokens_per_block, h).astype(jnp.float32)

    def body(state):
        i, r, m_KxSxG, l_KxSxG, acc_KxSxGxH = state
        # The chunk: ranks r .. r + C - 1 of block i; a rank past the slots is no slot (S).
        rank_C = r + jnp.arange(c)
        slot_C = jnp.where(rank_C < s, order_S[jnp.clip(rank_C, 0, s - 1)], s)
        safe_C = jnp.clip(slot_C, 0, s - 1)
        pages_CxB = jax.lax.dynamic_slice_in_dim(table_SxM[safe_C], i * block, block, axis=1)
        k_KxCxJxH, v_KxCxJxH = planes(pages_CxB, 0), planes(pages_CxB, 1)
        x_KxCxGxJ = jnp.einsum("ksgh,ksjh->ksgj", q_KxSxGxH[:, safe_C], k_KxCxJxH)
        key_pos_J = i * tokens_per_block + jnp.arange(tokens_per_block)
        length_C = jnp.where(slot_C < s, length_S[safe_C], 0)
        ok_CxJ = key_pos_J[None, :] < length_C[:, None]
        if sliding_window is not None:
            ok_CxJ &= (length_C - 1)[:, None] - key_pos_J[None, :] < sliding_window
        x_KxCxGxJ = jnp.where(ok_CxJ[None, :, None, :], x_KxCxGxJ, -jnp.inf)
        m_new, l_new, acc_new = _online_softmax(
            m_KxSxG[:, safe_C], l_KxSxG[:, safe_C], acc_KxSxGxH[:, safe_C], x_KxCxGxJ,
            v_KxCxJxH)
        # Each slot is in the chunk once (ranks are distinct); "no slot" writes nothing.
        m_KxSxG = m_KxSxG.at[:, slot_C].set(m_new, mode="drop")
        l_KxSxG = l_KxSxG.at[:, slot_C].set(l_new, mode="drop")
        acc_KxSxGxH = acc_KxSxGxH.at[:, slot_C].set(acc_new, mode="drop")
        r = r + c
        more = r < live_I[jnp.clip(i, 0, num_blocks_total - 1)]
        return (jnp.where(more, i, i + 1), jnp.where(more, r, 0), m_KxSxG, l_KxSxG,
                acc_KxSxGxH)

    init = (jnp.int32(0), jnp.int32(0), jnp.full((k, s, g), -jnp.inf, jnp.float32),
            jnp.zeros((k, s, g), jnp.float32), jnp.zeros((k, s, g, h), jnp.float32))
    _, _, _, l_KxSxG, acc_KxSxGxH = _over_blocks(body, init, num_blocks, num_blocks_total, s,
                                                 c, unroll)
    out_KxSxGxH = acc_KxSxGxH / jnp.where(l_KxSxG > 0, l_KxSxG, 1.0)[..., None]
    out_SxKxGxH = out_KxSxGxH.transpose(1, 0, 2, 3)
    return out_SxKxGxH.reshape(s, n, h).astype(q_SxNxH.dtype)


def _over_blocks(body, init, num_blocks: jax.Array, num_blocks_total: int, s: int, c: int,
                 unroll: bool):
    """`body` applied to `init` over the live (block, chunk) pairs: a while loop up to
    `num_blocks`; one call when one chunk and one block is all (no loop: a per-layer cost);
    with `unroll` every block of every chunk of the S slots, loop-free."""
    if num_blocks_total == 1 and c == s:
        return body(init)
    if unroll:
        state = init
        for i in range(num_blocks_total):
            for r in range(0, s, c):
                state = body((jnp.int32(i), jnp.int32(r), *state[2:]))
        return state
    return jax.lax.while_loop(lambda st: st[0] < num_blocks, body, init)


def _kv_heads_split() -> bool:
    """Whether the active sharding rules split the pool's KV heads over several devices."""
    active = active_rules()
    if active is None:
        return False
    mesh, rules = active
    return math.prod(mesh.shape.get(a, 1) for a in rules.mesh_axes("act_kv_heads")) > 1


def chunk_slots(num_slots: int) -> int:
    """C: the slots the XLA path gathers a block for at once: an eighth of them, at least 8
    (each chunk is one more loop trip per layer: fewer, larger chunks where slots are few;
    against one chunk of all slots: benchmarks/README.md, "Only live KV read")."""
    return min(num_slots, max(8, -(-num_slots // 8)))



def _block_plan(length_S: jax.Array, tokens_per_block: int, num_blocks_total: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(order_S, live_I, num_blocks): the slots longest first; how many of them reach each
    block of `tokens_per_block` keys (block i's live slots are the first live_I[i] of
    order_S); the blocks any slot reaches."""
    order_S = jnp.argsort(-length_S, stable=True).astype(jnp.int32)
    blocks_S = (length_S + tokens_per_block - 1) // tokens_per_block
    live_I = jnp.sum(blocks_S[None, :] > jnp.arange(num_blocks_total)[:, None], axis=1,
                     dtype=jnp.int32)
    return order_S, live_I, jnp.sum(live_I > 0, dtype=jnp.int32)


def _online_softmax(m_old, l_old, acc_old, x_KxCxGxJ, v_KxCxJxH):
    """One block of keys folded into the running softmax (flash attention's update):

        m' = max(m, max_j x_j)     l' = l e^(m - m') + sum_j e^(x_j - m')
        acc' = acc e^(m - m') + sum_j e^(x_j - m') v_j          (out = acc / l at the end)

    Rows with nothing seen yet keep m = -inf; they shift by 0 to avoid inf - inf."""
    m_new = jnp.maximum(m_old, jnp.max(x_KxCxGxJ, axis=-1))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p_KxCxGxJ = jnp.exp(x_KxCxGxJ - shift[..., None])
    correction = jnp.exp(m_old - shift)
    l_new = l_old * correction + jnp.sum(p_KxCxGxJ, axis=-1)
    acc_new = acc_old * correction[..., None] + jnp.einsum(
        "ksgj,ksjh->ksgh", p_KxCxGxJ, v_KxCxJxH)
    return m_new, l_new, acc_new

def _pallas(q_SxNxH, kv_pages_PxTx2KxH, page_table_SxM, length_S, *, scale, sliding_window,
            pages_per_block):
    """The TPU kernel on one query per slot (cu_q_lens 0, 1, ..., S)."""
    if jax.default_backend() != "tpu":
        raise ValueError(f"rollout.engine.attention=pallas runs the TPU kernel "
                         f"ragged_paged_attention; this backend is {jax.default_backend()!r} "
                         f"(use 'xla' or 'auto')")
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    return ragged_paged_attention(*pallas_arguments(q_SxNxH, kv_pages_PxTx2KxH, page_table_SxM,
                                                    length_S),
                                  sm_scale=scale, sliding_window=sliding_window,
                                  num_kv_pages_per_block=min(pages_per_block,
                                                             page_table_SxM.shape[1]),
                                  num_queries_per_block=1)


def pallas_arguments(q_SxNxH, kv_pages_PxTx2KxH, page_table_SxM, length_S):
    """The positional arguments of the TPU kernel (and of its reference) for decode queries."""
    s = q_SxNxH.shape[0]
    cu_q_lens = jnp.arange(s + 1, dtype=jnp.int32)
    num_pages = kv_pages_PxTx2KxH.shape[0]
    table = jnp.clip(page_table_SxM, 0, num_pages - 1).astype(jnp.int32)
    return (q_SxNxH, kv_pages_PxTx2KxH, length_S.astype(jnp.int32), table, cu_q_lens,
            jnp.array([s], jnp.int32))


def resolve_impl(attention: str, model_config, *, num_slots: int, num_pages: int,
                 page_size: int, table_width: int) -> str:
    """`auto`: the TPU kernel on TPU when its static checks take a pool of these shapes
    (`num_pages` pages of `page_size` tokens, `table_width` pages per slot), else XLA."""
    if attention != "auto":
        return attention
    if jax.default_backend() != "tpu":
        return "xla"
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import static_validate_inputs

    c = model_config
    q = jax.ShapeDtypeStruct((num_slots, c.num_heads, c.head_dim), c.compute_dtype)
    kv = jax.ShapeDtypeStruct((num_pages, page_size, 2 * c.num_kv_heads,
                               c.head_dim), c.compute_dtype)
    table = jax.ShapeDtypeStruct((num_slots, table_width), jnp.int32)
    try:
        args = jax.eval_shape(pallas_arguments, q, kv, table,
                              jax.ShapeDtypeStruct((num_slots,), jnp.int32))
        static_validate_inputs(*args, sm_scale=c.head_dim ** -0.5,
                               sliding_window=c.sliding_window)
    except (ValueError, NotImplementedError):
        return "xla"
    return "pallas"
