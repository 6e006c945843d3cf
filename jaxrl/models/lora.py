"""LoRA adapters on the decoder's projections, one per Hugging Face module (PEFT's layout).

For an HF linear module with weight W [out, in] (ours: a slice of a fused kernel [in, out]),

    y = x W^T + s · (x A^T) B^T,      A [r, in], B [out, r], s = alpha / r

with A drawn as PEFT draws it (kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in))) and B = 0, so a new
adapter leaves the model unchanged. We store A as [in..., r] and B as [r, out...] in the axes of
the kernel it adapts (q's B is [r, kv_heads, G, head_dim] like the fused q/k/v kernel's q part),
so each one carries the kernel's logical axes and is sharded like it; the rank axis is
replicated. Adapters exist per HF module (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj) even though our q/k/v and gate/up kernels are fused: exporting them to PEFT is then
a transpose and a reshape (`jaxrl.models.lora_peft`), never an approximation.

Why our own ~200 lines on flax NNX's `nnx.LoRAParam` rather than a library's adapter modules:
- qwix's LoRA (Tunix) intercepts the dot_general/einsum of matched modules and adds one
  adapter per intercepted op. Ours are fused (one einsum for q, k and v; one for gate and up)
  and run through a custom-VJP `dense`, so qwix would attach one adapter to the fused kernel:
  a rank-r update of [E, K·(G+2)·H] is no set of three independent rank-r PEFT adapters, and
  the export to PEFT (q_proj/k_proj/v_proj each with its own A) would be impossible.
- `nnx.LoRA` / `nnx.LoRALinear` wrap a plain [in, out] Linear; our kernels are head-split and
  fused, so they would need the same reshapes as here plus a module per HF projection.
What we do take from flax is the variable type: adapter weights are `nnx.LoRAParam`, so the
optimizer and the gradient take `nnx.LoRAParam` (`trainable`) and the frozen base stays
`nnx.Param`. Note `nnx.LoRAParam` subclasses `nnx.Param`: a `nnx.Param` filter selects both.

The rollout applies the adapters one of two ways (`LoraConfig.rollout`, benchmarks/lora.py):
"merged" folds them into the base kernels once per step, W' = W + s · A B
(`jaxrl.models.lora_merge`), and decodes on plain weights; "on_the_fly" adds s · (x A) B to
each projection at every token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.dense import dense
from jaxrl.models.lora_config import LoraConfig


def adapter_axes(module: str, config) -> tuple[tuple[tuple[int, ...], tuple], tuple[tuple[int, ...], tuple]]:
    """((in shape, in axes), (out shape, out axes)) of `module`'s adapter in our layout."""
    e, f, h = config.hidden_size, config.intermediate_size, config.head_dim
    n, k = config.num_heads, config.num_kv_heads
    hidden = ((e,), ("embed",))
    return {
        "q_proj": (hidden, ((k, n // k, h), ("kv_heads", None, "head_dim"))),
        "k_proj": (hidden, ((k, h), ("kv_heads", "head_dim"))),
        "v_proj": (hidden, ((k, h), ("kv_heads", "head_dim"))),
        "o_proj": (((n, h), ("heads", "head_dim")), hidden),
        "gate_proj": (hidden, ((f,), ("mlp",))),
        "up_proj": (hidden, ((f,), ("mlp",))),
        "down_proj": (((f,), ("mlp",)), hidden),
    }[module]


def adapter_params(config, lora: LoraConfig) -> int:
    """Parameters of `lora`'s adapters on a model of `config`: rank x (in + out) per targeted
    module and layer (counted without making them)."""
    per_layer = 0
    for module in lora.targets:
        (in_shape, _), (out_shape, _) = adapter_axes(module, config)
        per_layer += math.prod(in_shape) + math.prod(out_shape)
    return config.num_layers * lora.rank * per_layer


class Adapter(nnx.Module):
    """One HF module's adapter: a [in..., r], b [r, out...] (module docstring)."""

    def __init__(self, module: str, config, rngs: nnx.Rngs):
        lora = config.lora
        (in_shape, in_axes), (out_shape, out_axes) = adapter_axes(module, config)
        self.in_ndim = len(in_shape)
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a = jax.random.uniform(rngs.lora(), (*in_shape, lora.rank), config.param_dtype,
                               -bound, bound)
        self.a = nnx.LoRAParam(a, out_sharding=(*in_axes, None), eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros((lora.rank, *out_shape), config.param_dtype),
                               out_sharding=(None, *out_axes), eager_sharding=False)

    def delta(self, x_BxTxI: jax.Array, scale: float, dtype) -> jax.Array:
        """s · (x A) B for x [B, T, in] (in flattened): [B, T, out] (out flattened)."""
        a_IxR = self.a[...].astype(dtype).reshape(-1, self.a.shape[-1])
        b_RxO = self.b[...].astype(dtype).reshape(self.a.shape[-1], -1)
        xa_BxTxR = dense(x_BxTxI, a_IxR, "bti,ir->btr") * jnp.asarray(scale, dtype)
        return dense(xa_BxTxR, b_RxO, "btr,ro->bto")

    def product(self, scale: float) -> jax.Array:
        """s · A B as [lead..., in..., out...] (lead: the stacked-layers axis, if any)."""
        a, b = self.a[...], self.b[...]
        r = a.shape[-1]
        lead = a.shape[:a.ndim - 1 - self.in_ndim]
        in_shape, out_shape = a.shape[len(lead):-1], b.shape[len(lead) + 1:]
        ab_LxIxO = jnp.einsum("...ir,...ro->...io", a.reshape(*lead, -1, r),
                              b.reshape(*lead, r, -1))
        return scale * ab_LxIxO.reshape(*lead, *in_shape, *out_shape)


class Adapters(nnx.Module):
    """The adapters of one attention or MLP module, as attributes named by HF module."""

    def __init__(self, modules: tuple[str, ...], config, rngs: nnx.Rngs):
        self.scale = config.lora.scale
        for module in modules:
            setattr(self, module, Adapter(module, config, rngs))

    def delta(self, module: str, x_BxTxI: jax.Array, dtype) -> jax.Array | None:
        """s · (x A) B of `module`'s adapter, None when it has none."""
        adapter = getattr(self, module, None)
        return None if adapter is None else adapter.delta(x_BxTxI, self.scale, dtype)


def make_adapters(group: tuple[str, ...], config, rngs: nnx.Rngs) -> Adapters | None:
    """The adapters of `config.lora` among `group` (attention or MLP modules), or None."""
    if config.lora is None:
        return None
    modules = tuple(m for m in group if m in config.lora.targets)
    return Adapters(modules, config, rngs) if modules else None


def trainable(model: nnx.Module) -> type[nnx.Variable]:
    """What the optimizer trains in `model`: the adapters with LoRA, else every parameter
    (also of a module without a `config`)."""
    lora = getattr(getattr(model, "config", None), "lora", None)
    return nnx.LoRAParam if lora is not None else nnx.Param
