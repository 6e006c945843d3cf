"""Sequence packing for the train phase: a microbatch's rows laid end to end into a few rows,
so the trainer's forwards and backwards cost the real tokens, not rows x padded width.

    plan      = plan_rows(mask_BxT)              row b -> packed row r_b, from offset o_b
    ids_RxL   = pack(ids_BxT, plan, R)           the real tokens of each row, in order
    y_BxC     = unpack(y_RxL, plan)              per-token outputs back at the completion columns

Rows are placed next-fit in decreasing length (a scan over the B row lengths): a packed row of
width L = T (the padded width: any row fits) takes rows until the next does not fit. Segment
b + 1 marks row b's tokens (0: padding), its positions are the row's own (`default_positions`
of its mask), and attention stays inside a segment (`Transformer.hidden_states_packed`), so
every real token's hidden state is the one the padded row gives it, up to float rounding.

One compilation, a few shapes: a microbatch of B rows runs packed into R_k rows for the
smallest budget R_k of `budgets` (at most three: B/4, B/2, 3B/4, rounded up to the devices
that split the rows) that holds it, or padded as before when none does, chosen at run time
by `lax.switch`; every branch is compiled into the one program (so at most four forward and
four forward + backward bodies per program). A budget is kept only when its R_k x L
positions are fewer than the padded forward's (B x C completion positions + the prompts, P
each, once per `prompt_group` rows: with prompts shared, equal lengths never pack), and
only for completions of `MIN_COMPLETION` tokens or more.

Why packing and not length buckets: the microbatches keep their rows, so every per-microbatch
quantity (the top-entropy quantile, the MoE load-balancing statistics, the loss shares) is
computed over the same tokens as before; only the layout of the work changes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.models.transformer import default_positions


class PackPlan(NamedTuple):
    """Where each real token of a [B, T] microbatch goes in packed rows of width T."""

    dest_BxT: jax.Array  # flat index r * T + o into the packed rows; B * T: padding (dropped)
    predictor_BxC: jax.Array  # flat index of the position predicting completion token c
    rows_used: jax.Array  # int32: packed rows holding a token


# Completions shorter than this never pack: lengths cannot spread far enough below so short
# a cap to repay the packed branches' compilation (the rollout's tail halving draws the same
# line, `jaxrl.rollout.slot_count.TAIL_TOKENS`).
MIN_COMPLETION = 32


def budgets(rows: int, width: int, completion_len: int, prompt_group: int = 1,
            shards: int = 1) -> tuple[int, ...]:
    """The packed row counts a microbatch of `rows` rows [P prompt + C completion columns,
    P + C = `width`] may run at (module docstring); () when none beats the padded forward,
    or C < `MIN_COMPLETION`."""
    if completion_len < MIN_COMPLETION:
        return ()
    padded = rows * completion_len + rows // prompt_group * (width - completion_len)
    out: list[int] = []
    for quarter in (1, 2, 3):
        r = -(-rows * quarter // 4)
        r = -(-r // shards) * shards
        if r < rows and r * width < padded and r not in out:
            out.append(r)
    return tuple(out)


def plan_rows(mask_BxT: jax.Array, completion_len: int) -> PackPlan:
    """Next-fit in decreasing length of the rows' real tokens (`mask_BxT`) into rows of
    width T; `completion_len`: C, the last C columns being the completion."""
    b, t = mask_BxT.shape
    mask_BxT = mask_BxT.astype(bool)
    length_B = jnp.sum(mask_BxT, axis=1, dtype=jnp.int32)
    order_B = jnp.argsort(-length_B, stable=True)

    def place(carry, n):
        row, used = carry
        full = used + n > t
        row, used = jnp.where(full, row + 1, row), jnp.where(full, 0, used)
        return (row, used + n), (row, used)

    zero = jnp.zeros((), jnp.int32)
    (last, _), (row_sorted, offset_sorted) = jax.lax.scan(place, (zero, zero),
                                                          length_B[order_B])
    row_B = jnp.zeros_like(length_B).at[order_B].set(row_sorted)
    offset_B = jnp.zeros_like(length_B).at[order_B].set(offset_sorted)
    within_BxT = jnp.cumsum(mask_BxT, axis=1, dtype=jnp.int32) - 1
    dest_BxT = jnp.where(mask_BxT, row_B[:, None] * t + offset_B[:, None] + within_BxT, b * t)
    # Completion token c is predicted at column P - 1 + c (a real token when c is).
    p = t - completion_len
    predictor_BxC = jnp.where(mask_BxT[:, p - 1:t - 1], dest_BxT[:, p - 1:t - 1], 0)
    return PackPlan(dest_BxT, predictor_BxC, last + 1)


def branch(plan: PackPlan, row_budgets: tuple[int, ...]) -> jax.Array:
    """Index of the smallest budget holding the plan's rows, len(row_budgets) for none."""
    fits_K = plan.rows_used <= jnp.asarray(row_budgets, jnp.int32)
    return jnp.where(jnp.any(fits_K), jnp.argmax(fits_K), len(row_budgets)).astype(jnp.int32)


def pack(x_BxT: jax.Array, plan: PackPlan, rows: int) -> jax.Array:
    """x's real tokens in `rows` packed rows [rows, T], zero elsewhere."""
    t = x_BxT.shape[1]
    flat = jnp.zeros((rows * t,), x_BxT.dtype)
    return flat.at[plan.dest_BxT.reshape(-1)].set(x_BxT.reshape(-1), mode="drop").reshape(rows, t)


def packed_inputs(ids_BxT: jax.Array, mask_BxT: jax.Array, plan: PackPlan, rows: int,
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(ids_RxL, positions_RxL, segments_RxL, targets_RxL) of the packed rows; the target of
    a position is the next token of its row (garbage at a segment's last token, never read)."""
    b = ids_BxT.shape[0]
    segment_BxT = jnp.broadcast_to(jnp.arange(1, b + 1, dtype=jnp.int32)[:, None], mask_BxT.shape)
    ids_RxL = pack(ids_BxT, plan, rows)
    targets_RxL = jnp.concatenate([ids_RxL[:, 1:], jnp.zeros_like(ids_RxL[:, :1])], axis=1)
    return (ids_RxL, pack(default_positions(mask_BxT), plan, rows),
            pack(segment_BxT, plan, rows), targets_RxL)


def unpack(y_RxL: jax.Array, plan: PackPlan) -> jax.Array:
    """y at the positions predicting the completion tokens, [B, C, ...] (garbage where the
    completion column is padding: callers mask it, as they mask the padded forward's)."""
    flat = y_RxL.reshape(-1, *y_RxL.shape[2:])
    return flat[plan.predictor_BxC]


def real_tokens(mask_BxT: jax.Array) -> jax.Array:
    """The microbatch's real (prompt + completion) tokens, float32."""
    return jnp.sum(mask_BxT, dtype=jnp.float32)
