"""The KV page pool's bookkeeping: which pages are free, and which a new row takes.

The pool has `num_pages` pages of `page_size` tokens (`PoolLayout`). Its first pages are the
prompt region: prompt p of a call owns pages [p * Mp, (p + 1) * Mp) (Mp = pages of the longest
prompt) for the whole call, so the G samples of a prompt read the same pages. The rest are
row pages, handed out from a free stack (`FreePages`): a row takes, when it is inserted, the
pages its worst case needs (its `max_new_tokens`), and gives them back when it finishes, so
the next row reuses them. Taking the worst case at insertion means a live row can never run
out of pages (no preemption, unlike vLLM's optimistic allocation); a row waits for a slot
until enough pages are free.

A row of prompt p (n_p real tokens) with limit C_r writes keys/values at positions
n_p .. n_p + C_r - 2 (its last token is never fed back). Pages are T tokens; the prompt's
full pages, floor(n_p / T), are shared; a partial last prompt page is copied into the row's
first own page (the row writes after it). Own pages:

    w_r = floor((n_p + C_r - 2) / T) - floor(n_p / T) + 1     (0 when C_r = 1)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Static shape of one call's pool."""

    page_size: int
    num_prompts: int
    prompt_pages: int  # Mp: pages of the longest prompt
    row_pages: int  # pages of the row region (the free stack's capacity)
    table_width: int  # M: page-table entries per slot (the longest row's pages)

    @property
    def num_pages(self) -> int:
        return self.num_prompts * self.prompt_pages + self.row_pages

    @classmethod
    def plan(cls, *, page_size: int, num_prompts: int, prompt_len: int, max_new_tokens: int,
             num_slots: int, row_pages: int | None = None) -> PoolLayout:
        """The pool for prompts up to `prompt_len` tokens and rows up to `max_new_tokens`.

        `row_pages` None: enough for every slot's worst case at once (no row ever waits for
        pages). Fewer pages are allowed down to one worst-case row. A page is at most as long
        as the longest row's cache (prompt_len + max_new_tokens - 1 tokens): longer, the
        decode step would read padding only.
        """
        if page_size < 1:
            raise ValueError(f"rollout.engine.page_size must be >= 1, got {page_size}")
        page_size = min(page_size, prompt_len + max_new_tokens - 1)
        prompt_pages = -(-prompt_len // page_size)
        worst = worst_row_pages(prompt_len, max_new_tokens, page_size)
        if row_pages is None:
            row_pages = num_slots * worst
        elif row_pages < worst:
            raise ValueError(f"a KV pool of {row_pages} row pages cannot hold one row of "
                             f"{prompt_len} prompt + {max_new_tokens} new tokens "
                             f"({worst} pages of {page_size} tokens); expected >= {worst}")
        table_width = (prompt_len + max_new_tokens - 2) // page_size + 1
        return cls(page_size, num_prompts, prompt_pages, max(row_pages, 1), table_width)


def worst_row_pages(prompt_len: int, max_new_tokens: int, page_size: int) -> int:
    """The most own pages any row of a prompt up to `prompt_len` tokens takes (max over n_p)."""
    return int(np.max(own_pages(np.arange(1, prompt_len + 1), max_new_tokens, page_size)))


def own_pages(n_prompt, limit, page_size):
    """w_r of the module docstring, elementwise (Python ints, numpy or jax arrays)."""
    return ((n_prompt + limit - 2) // page_size - n_prompt // page_size + 1) * (limit >= 2)


@struct.dataclass
class FreePages:
    """A stack of free row-page ids: `ids_F[:count]` are free (the top is at count - 1)."""

    ids_F: jax.Array
    count: jax.Array

    @classmethod
    def full(cls, layout: PoolLayout) -> FreePages:
        first = layout.num_prompts * layout.prompt_pages
        return cls(first + jnp.arange(layout.row_pages, dtype=jnp.int32),
                   jnp.int32(layout.row_pages))


def take(free: FreePages, need_S: jax.Array, width: int) -> tuple[FreePages, jax.Array]:
    """Pops need_S[s] pages for each slot (the caller checked they fit): pages_SxW, -1 padded.

    Slots take consecutive runs from the top of the stack in slot order.
    """
    start_S = free.count - jnp.cumsum(need_S)  # slot s takes ids_F[start_S[s] : +need_S[s]]
    j_W = jnp.arange(width)
    index_SxW = start_S[:, None] + j_W[None, :]
    pages_SxW = jnp.where(j_W[None, :] < need_S[:, None],
                          free.ids_F[jnp.clip(index_SxW, 0, free.ids_F.shape[0] - 1)], -1)
    return FreePages(free.ids_F, free.count - jnp.sum(need_S)), pages_SxW


def give_back(free: FreePages, pages_SxW: jax.Array) -> FreePages:
    """Pushes every page id >= 0 of `pages_SxW` (row-major order) back on the stack."""
    flat_N = pages_SxW.reshape(-1)
    keep_N = flat_N >= 0
    slot_N = free.count + jnp.cumsum(keep_N) - 1
    slot_N = jnp.where(keep_N, slot_N, free.ids_F.shape[0])  # dropped
    ids_F = free.ids_F.at[slot_N].set(flat_N, mode="drop")
    return FreePages(ids_F, free.count + jnp.sum(keep_N, dtype=jnp.int32))
