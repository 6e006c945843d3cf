"""The server's driver of the engine: one request at a time, as JetStream's Engine calls it.

    layout         = pool_layout(slots, max_prefill_length, max_new_tokens, page_size)
    state          = slots.init(model_config, layout, slots)
    prefix      = prefill_request(model, ids_L, n, key, ...)   a prompt's keys/values and
                                                               its first token
    state       = insert_request(state, prefix, slot, layout)  the slot starts that request
    state, sent = emit_and_generate(model, state, layout, ...) per slot: the token drawn
                                                               before, emitted now; the
                                                               next one drawn

(JetStream's Engine calls these three `prefill`, `insert` and `generate`.)

Pure JAX, no JetStream: `jaxrl.serve` wraps these in JetStream's Engine, on a mesh each
device running them on its own slots and pool (`jaxrl.rollout.slots_on_mesh`). The ops are the
engine's (`jaxrl.rollout.slots`), the RL loop's, so a served greedy completion is the one
`jaxrl generate` prints, and a request's tokens equal the RL engine's row with the same key.

Each slot is a request's home: its prompt's pages; its new tokens take pages from the free
stack at insertion and give them back when the request ends (a stop token or its
`max_new_tokens`-th token: the device knows) or when another request is inserted over it
(JetStream frees a slot as soon as a request has the tokens it asked for).

JetStream 0.2.2 emits tokens only from `generate`, so a token is emitted one call after it
was drawn (`slots.take_pending`): the first token, drawn at prefill, by the first
`generate` after `insert`; a request's k-th token by its k-th call; a slot emits nothing
(`valid` 0) once its request's last token was emitted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models import Transformer
from jaxrl.rollout import slots
from jaxrl.rollout.pages import PoolLayout
from jaxrl.rollout.sampling import SamplingParams

# A request after `prefill`: its prompt's keys/values and itself as a row to start.
Request = tuple[slots.Prefix, slots.Starts]
# The memory fit's ceiling per device: beyond, a decode step's latency grows for little.
MAX_FIT_SLOTS = 512


def pool_layout(num_slots: int, max_prefill_length: int, max_new_tokens: int,
                page_size: int) -> PoolLayout:
    """A server's pool: one home per slot for prompts up to `max_prefill_length` tokens, and
    row pages for every slot's `max_new_tokens` at once."""
    for name, value in (("num_slots", num_slots), ("max_prefill_length", max_prefill_length),
                        ("max_new_tokens", max_new_tokens), ("page_size", page_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return PoolLayout.plan(page_size=page_size, num_prompts=num_slots,
                           prompt_len=max_prefill_length, max_new_tokens=max_new_tokens,
                           num_slots=num_slots)


def slot_bytes(model_config, max_prefill_length: int, max_new_tokens: int,
               page_size: int) -> int:
    """KV bytes of one slot: its pages x layers x 2 x kv heads x head dim x dtype."""
    c = model_config
    layout = pool_layout(1, max_prefill_length, max_new_tokens, page_size)
    item = jnp.dtype(c.compute_dtype).itemsize
    return (layout.num_pages * layout.page_size * c.num_layers * 2 * c.num_kv_heads
            * c.head_dim * item)


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


def prefill_request(model: Transformer, ids_L: jax.Array, length: jax.Array, key: jax.Array,
                    sampling: SamplingParams, max_new_tokens: int) -> Request:
    """A right-padded prompt (`length` real tokens of `ids_L`) through the model once, as
    the RL loop's prefill runs a left-padded one (the same numbers), and its first token
    drawn with fold_in(key, 0): the prompt's keys/values and the request as a row to start."""
    width = ids_L.shape[0]
    shift = width - length
    ids_1xL = jnp.roll(ids_L, shift)[None]  # left-padded
    mask_1xL = (jnp.arange(width) >= shift)[None]
    prefix = slots.prefill(model, ids_1xL, mask_1xL)
    return prefix, slots.one_row(prefix, jax.random.key_data(key), max_new_tokens, sampling)


def insert_request(state: slots.SlotState, prefix: Request, slot: jax.Array,
                   layout: PoolLayout, stops: slots.Stops) -> slots.SlotState:
    """The slot starts the prefix's request: its keys/values into the slot's home pages,
    its first token pending (whatever the slot held before gives its pages back)."""
    kv, request = prefix
    return slots.insert_home(state, layout, kv, request, slot, stops)


def emit_and_generate(model: Transformer, state: slots.SlotState, layout: PoolLayout,
                      stops: slots.Stops, sampling: SamplingParams,
                      attention: slots.PagedAttentionSettings
                      ) -> tuple[slots.SlotState, slots.Sent]:
    """Every slot with a token drawn and not yet emitted emits it; every decoding slot
    feeds its last token and draws the next."""
    state, sent = slots.take_pending(state)
    state, _ = slots.generate(model, state, layout, attention, stops, sampling)
    return state, sent
