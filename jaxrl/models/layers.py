"""Building blocks: parameters with logical axes, RMSNorm, rotary embeddings, SwiGLU MLP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl.models.config import ModelConfig
from jaxrl.sharding import constrain

INIT_STD = 0.02  # transformers' default initializer_range


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter tagged with logical axis names; the sharding rules place it later."""
    if len(axes) != value.ndim:
        raise ValueError(f"axes {axes} do not match parameter shape {value.shape}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], config: ModelConfig) -> jax.Array:
    return INIT_STD * jax.random.normal(rngs.params(), shape, config.param_dtype)


DENSE = "dense"  # the checkpoint name of every `dense` output (remat policies save it)


def dense(x: jax.Array, w: jax.Array, spec: str, out_dtype=None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a projection "<x axes>,<w axes>-><out axes>" (no axis of w
    is a batch axis), with the gradients written as einsums into the operands' own axes:

        dx = einsum("<out>,<w>-><x>", dy, w)        dw = einsum("<x>,<out>-><w>", x, dy)

    dw's contraction runs over the tokens, the major axis of both x and dy: XLA:CPU's dot
    transposes its first operand into [features, tokens] for it. Autodiff always puts dy
    first, which for an expanding projection is the wide one (gate/up: [4096, 1536] dy
    against [4096, 256] x in the vs-TRL step); here the narrower goes first. Same sums;
    GPU/TPU dots take either order without a copy. `out_dtype`: the
    einsum's preferred_element_type (float32 logits). The output is named `DENSE` for remat
    policies (a custom-VJP call is no dot to `dots_with_no_batch_dims_saveable`)."""
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
    # The narrower of x and dy first: that is the operand XLA:CPU transposes. A dot_general
    # (jnp.einsum may swap its operands) into its natural order, then w's axes (weight-sized).
    first, second = (x, dy) if x.size <= dy.size else (dy, x)
    axes1, axes2 = (x_axes, out) if first is x else (out, x_axes)
    tokens = [a for a in x_axes if a not in w_axes]
    dims = (([axes1.index(a) for a in tokens], [axes2.index(a) for a in tokens]), ((), ()))
    dw = jax.lax.dot_general(first, second, dims, preferred_element_type=w.dtype)
    natural = [a for a in axes1 if a not in tokens] + [a for a in axes2 if a not in tokens]
    dw = dw.transpose([natural.index(a) for a in w_axes])
    return dx.astype(x.dtype), dw.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, normalised in fp32 (as transformers does)."""

    def __init__(self, size: int, axis: str, eps: float, config: ModelConfig):
        self.scale = param(jnp.ones((size,), config.param_dtype), (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype) * self.scale[...].astype(x.dtype)


def apply_rope(x_BxTx_xH: jax.Array, positions_BxT: jax.Array,
               inv_freq_H2: jax.Array) -> jax.Array:
    """Rotary embedding in the half-split convention of transformers' `rotate_half`, on
    [B, T, (head axes...), H].

    With angle_{t,i} = position_t * inv_freq_i and x = [x1, x2] split in halves:
    y = [x1 cos - x2 sin, x2 cos + x1 sin].
    """
    angles_BxTxH2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq_H2
    heads = (1,) * (x_BxTx_xH.ndim - 3)
    angles = angles_BxTxH2.reshape(*angles_BxTxH2.shape[:2], *heads, -1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x_BxTx_xH.astype(jnp.float32), 2, axis=-1)
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return y.astype(x_BxTx_xH.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up)), gate and up as one [E, 2, F] kernel (one
    matmul of 2F columns instead of two of F; split at the HF boundary, `hf_names`)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        e, f = config.hidden_size, config.intermediate_size
        # Drawn as gate then up (the random init a seed gives is unchanged).
        self.gate_up = param(jnp.stack([normal(rngs, (e, f), config) for _ in "gu"], axis=1),
                             ("embed", "gate_up", "mlp"))
        self.down = param(normal(rngs, (f, e), config), ("mlp", "embed"))
        self.dtype = config.compute_dtype

    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        dt = self.dtype
        gate_up_BxTx2xF = dense(x_BxTxE, self.gate_up[...].astype(dt), "bte,ecf->btcf")
        gate_BxTxF, up_BxTxF = gate_up_BxTx2xF[:, :, 0], gate_up_BxTx2xF[:, :, 1]
        h_BxTxF = constrain(jax.nn.silu(gate_BxTxF) * up_BxTxF, ("batch", "seq", "act_mlp"))
        return dense(h_BxTxF, self.down[...].astype(dt), "btf,fe->bte")
