"""Projections with a hand-written gradient: `dense(x, w, spec)` is `jnp.einsum(spec, x, w)`
of an activation x and a weight w, for specs "<x axes>,<w axes>-><out axes>" in which no axis
of w is a batch axis. Its gradients are the einsums into the operands' own axes,

    dx = einsum("<out>,<w>-><x>", dy, w)        dw = einsum("<x>,<out>-><w>", x, dy)

with autodiff's sums, written so that XLA:CPU moves less data: dw contracts over the tokens,
the major axis of both x and dy, and XLA:CPU's dot transposes its first operand into
[features, tokens] for that. Autodiff always puts dy first, for an expanding projection the
wide one (gate/up: dy is [tokens, 6E] against x's [tokens, E]); here the narrower of the two
goes first. GPU/TPU dots take either order without a copy.

Outputs are checkpoint-named `DENSE`, which the "save_dots" remat policy saves (a custom-VJP
call is no dot to `dots_with_no_batch_dims_saveable`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

DENSE = "dense"


def dense(x: jax.Array, w: jax.Array, spec: str, out_dtype=None) -> jax.Array:
    """`jnp.einsum(spec, x, w, preferred_element_type=out_dtype)` (module docstring)."""
    return checkpoint_name(_dense(x, w, spec, out_dtype), DENSE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x, w, spec, out_dtype):
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _dense_fwd(x, w, spec, out_dtype):
    return _dense(x, w, spec, out_dtype), (x, w)


def _dense_bwd(spec, out_dtype, residuals, dy):
    x, w = residuals
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    dx = jnp.einsum(f"{out},{w_axes}->{x_axes}", dy, w, preferred_element_type=x.dtype)
    # One dot_general (jnp.einsum may swap its operands) with the narrower operand first,
    # into its natural order, then w's axes (a weight-sized transpose).
    first, second = (x, dy) if x.size <= dy.size else (dy, x)
    axes1, axes2 = (x_axes, out) if first is x else (out, x_axes)
    tokens = [a for a in x_axes if a not in w_axes]
    dims = (([axes1.index(a) for a in tokens], [axes2.index(a) for a in tokens]), ((), ()))
    dw = jax.lax.dot_general(first, second, dims, preferred_element_type=w.dtype)
    natural = [a for a in axes1 if a not in tokens] + [a for a in axes2 if a not in tokens]
    dw = dw.transpose([natural.index(a) for a in w_axes])
    return dx.astype(x.dtype), dw.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)
