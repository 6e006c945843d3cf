"""Building blocks: parameters with logical axes, RMSNorm, rotary embeddings, SwiGLU MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.dense import dense
from jaxrl.models.lora import make_adapters
from jaxrl.models.lora_config import MLP_MODULES
from jaxrl.sharding import constrain

INIT_STD = 0.02  # transformers' default initializer_range


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter tagged with logical axis names; the sharding rules place it later."""
    if len(axes) != value.ndim:
        raise ValueError(f"axes {axes} do not match parameter shape {value.shape}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], config: ModelConfig) -> jax.Array:
    return INIT_STD * jax.random.normal(rngs.params(), shape, config.param_dtype)


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


def rope_inverse_frequencies(config: ModelConfig) -> jnp.ndarray:
    """inv_freq_i = theta^(-2i/d), with Llama 3 scaling applied when configured.

    Llama 3 scaling keeps high frequencies (wavelength < L/high_freq_factor), divides low
    frequencies (wavelength > L/low_freq_factor) by `factor`, and interpolates smoothly
    in between, where L is the original context length.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, interpolated, scaled)


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
        self.lora = make_adapters(MLP_MODULES, config, rngs)  # drawn after the base

    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        dt = self.dtype
        gate_up_BxTx2xF = dense(x_BxTxE, self.gate_up[...].astype(dt), "bte,ecf->btcf")
        gate_BxTxF, up_BxTxF = gate_up_BxTx2xF[:, :, 0], gate_up_BxTx2xF[:, :, 1]
        if self.lora is not None:
            gate_BxTxF, up_BxTxF = (self._adapted(name, x_BxTxE, y) for name, y in
                                    (("gate_proj", gate_BxTxF), ("up_proj", up_BxTxF)))
        h_BxTxF = constrain(jax.nn.silu(gate_BxTxF) * up_BxTxF, ("batch", "seq", "act_mlp"))
        return self._adapted("down_proj", h_BxTxF,
                             dense(h_BxTxF, self.down[...].astype(dt), "btf,fe->bte"))

    def _adapted(self, module, x_BxTxI, y_BxTxO):
        """y plus `module`'s adapter output s · (x A) B (y as it is without one)."""
        delta = None if self.lora is None else self.lora.delta(module, x_BxTxI, self.dtype)
        return y_BxTxO if delta is None else y_BxTxO + delta
