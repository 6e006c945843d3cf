"""Folding LoRA adapters into the base kernels, W' = W + s · A B: what a rollout with
`LoraConfig.rollout = "merged"` decodes with and what an export without adapters saves. It
builds the adapter-free `Transformer`, so it sits above the model (`jaxrl.models.lora` is
below it: the model's layers make their adapters)."""

from __future__ import annotations

import dataclasses
import functools

from flax import nnx

from jaxrl.models.transformer import Transformer


@functools.lru_cache(maxsize=16)
def base_graphdef(config) -> nnx.GraphDef:
    """The graph of the model of `config` without adapters (what merged weights run on)."""
    base = dataclasses.replace(config, lora=None)
    return nnx.graphdef(nnx.eval_shape(lambda: Transformer(base, rngs=nnx.Rngs(0))))


def merged_params(model: nnx.Module) -> nnx.State:
    """The base parameters of `model` with its adapters folded in, W' = W + s · A B (fused
    kernels take each part's product in its slice): the state of `base_graphdef`."""
    scan = model.config.scan_layers
    for block in [model.layers] if scan else list(model.layers):
        attn, mlp = block.attn, block.mlp
        if attn.lora is not None:
            ad, g = attn.lora, model.config.num_heads // model.config.num_kv_heads
            qkv = attn.qkv_kernel[...]
            for module, part in (("q_proj", slice(0, g)), ("k_proj", g), ("v_proj", g + 1)):
                if hasattr(ad, module):
                    delta = getattr(ad, module).product(ad.scale).astype(qkv.dtype)
                    qkv = qkv.at[..., part, :].add(delta)
            attn.qkv_kernel[...] = qkv
            if hasattr(ad, "o_proj"):
                attn.o_kernel[...] += ad.o_proj.product(ad.scale).astype(attn.o_kernel.dtype)
        if getattr(mlp, "lora", None) is not None:  # (a mixture of experts' MLP has none)
            ad = mlp.lora
            gate_up = mlp.gate_up[...]
            for module, part in (("gate_proj", 0), ("up_proj", 1)):
                if hasattr(ad, module):
                    delta = getattr(ad, module).product(ad.scale).astype(gate_up.dtype)
                    gate_up = gate_up.at[..., part, :].add(delta)
            mlp.gate_up[...] = gate_up
            if hasattr(ad, "down_proj"):
                mlp.down[...] += ad.down_proj.product(ad.scale).astype(mlp.down.dtype)
    return nnx.state(model, nnx.Not(nnx.LoRAParam))


def rollout_view(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) the rollout decodes with: unchanged without LoRA or with
    `rollout: on_the_fly`; with `merged`, the base graph and `merged_params`."""
    model = nnx.merge(graphdef, params, copy=True)
    lora = model.config.lora
    if lora is None or lora.rollout == "on_the_fly":
        return graphdef, params
    return base_graphdef(model.config), merged_params(model)
