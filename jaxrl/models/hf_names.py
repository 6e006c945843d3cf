"""Which HF tensor(s) each of our parameters comes from, and how the layouts differ.

A torch `Linear` stores its weight as [out, in]; we store kernels as [in, out] with the head
axis split out, and fuse what runs on the same input into one kernel (one larger matmul):

    qkv_kernel [E, K, G+2, H]  from q_proj [N*H, E], k_proj [K*H, E], v_proj [K*H, E]:
                               kv head k holds its G = N/K query heads (query head k*G + g,
                               HF's grouping), then its key, then its value
    qkv_bias   [K, G+2, H]     from the three biases the same way
    o_kernel   [N, H, E]       from o_proj [E, N*H]
    gate_up    [E, 2, F]       from gate_proj [F, E] and up_proj [F, E]
    MoE, stored per expert x as the hub checkpoints are (transformers fuses them on load
    with its conversion mapping and splits them again on save); qwen3_moe names (mixtral:
    block_sparse_moe.gate, block_sparse_moe.experts.{x}.w1 / w3 / w2):
    router     [E, X]          from mlp.gate.weight [X, E]
    gate_up    [X, E, 2, F]    from mlp.experts.{x}.gate_proj / up_proj [F, E]
    down       [X, F, E]       from mlp.experts.{x}.down_proj [E, F]

Each layout converts the full HF tensors of a parameter to ours and back, and — for loading
onto a mesh — turns a slice of *our* array into the (contiguous) slices of the HF tensors that
hold it, so each device reads only its shard from disk (a fused q/k/v shard reads whole query
heads of its kv heads, then slices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import numpy as np

LayoutKind = Literal["copy", "transpose", "heads_out", "qkv_in", "qkv_bias", "pair_in",
                     "experts_pair_in", "experts_transpose"]

_QKV = tuple(f"self_attn.{p}_proj.weight" for p in "qkv")
_QKV_BIAS = tuple(f"self_attn.{p}_proj.bias" for p in "qkv")
# Our parameter path (inside a layer for `model.layers.{i}.` names) -> (HF names, layout).
_TOP = {
    ("embed",): (("model.embed_tokens.weight",), "copy"),
    ("final_norm", "scale"): (("model.norm.weight",), "copy"),
    ("lm_head",): (("lm_head.weight",), "transpose"),
}
_LAYER = {
    ("attn_norm", "scale"): (("input_layernorm.weight",), "copy"),
    ("mlp_norm", "scale"): (("post_attention_layernorm.weight",), "copy"),
    ("attn", "qkv_kernel"): (_QKV, "qkv_in"),
    ("attn", "o_kernel"): (("self_attn.o_proj.weight",), "heads_out"),
    ("attn", "qkv_bias"): (_QKV_BIAS, "qkv_bias"),
    ("attn", "o_bias"): (("self_attn.o_proj.bias",), "copy"),
    ("attn", "q_norm", "scale"): (("self_attn.q_norm.weight",), "copy"),
    ("attn", "k_norm", "scale"): (("self_attn.k_norm.weight",), "copy"),
    ("mlp", "gate_up"): (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "pair_in"),
    ("mlp", "down"): (("mlp.down_proj.weight",), "transpose"),
}
# Mixture-of-experts parameters by family: one HF tensor per expert (and per gate/up part).
_EXPERTS = {
    "qwen3_moe": {
        ("mlp", "router"): (("mlp.gate.weight",), "transpose"),
        ("mlp", "gate_up"): (("mlp.experts.{x}.gate_proj.weight",
                              "mlp.experts.{x}.up_proj.weight"), "experts_pair_in"),
        ("mlp", "down"): (("mlp.experts.{x}.down_proj.weight",), "experts_transpose"),
    },
    "mixtral": {  # w1: gate, w3: up, w2: down
        ("mlp", "router"): (("block_sparse_moe.gate.weight",), "transpose"),
        ("mlp", "gate_up"): (("block_sparse_moe.experts.{x}.w1.weight",
                              "block_sparse_moe.experts.{x}.w3.weight"), "experts_pair_in"),
        ("mlp", "down"): (("block_sparse_moe.experts.{x}.w2.weight",), "experts_transpose"),
    },
}

Index = tuple[slice, ...]
ReadFn = Callable[[Index], np.ndarray]  # reads a slice of the HF tensor


@dataclasses.dataclass(frozen=True)
class ParamName:
    """Where one of our variables lives in an HF checkpoint.

    `templates`: the HF tensors it is made of (several when fused). `layers` is None for a
    top-level parameter, the layer indices for a per-layer one; with `stacked` (scan_layers)
    our array has a leading layer axis holding all of them.
    """

    templates: tuple[str, ...]
    kind: LayoutKind
    layers: tuple[int, ...] | None
    stacked: bool

    def hf_names(self) -> list[tuple[str, ...]]:
        """Per layer (one entry for a top-level parameter), the HF names of its parts."""
        if self.layers is None:
            return [self.templates]
        return [tuple(f"model.layers.{i}.{t}" for t in self.templates) for i in self.layers]


def param_name(path: tuple[str | int, ...], num_layers: int, num_experts: int = 0,
               model_type: str = "") -> ParamName:
    """The HF name(s) of the variable at NNX state `path` (`layers.3.attn.q_kernel` ...);
    `num_experts` > 0: the MLP is a mixture of that many experts, named as `model_type`'s."""
    if path in _TOP:
        return ParamName(*_TOP[path], layers=None, stacked=False)
    if path[0] == "layers":
        if isinstance(path[1], int):
            layers, stacked, inner = (path[1],), False, path[2:]
        else:
            layers, stacked, inner = tuple(range(num_layers)), True, path[1:]
        if num_experts and inner in _EXPERTS[model_type]:
            templates, kind = _EXPERTS[model_type][inner]
            if kind.startswith("experts_"):
                templates = tuple(t.format(x=x) for x in range(num_experts) for t in templates)
            return ParamName(templates, kind, layers=layers, stacked=stacked)
        if inner in _LAYER:
            return ParamName(*_LAYER[inner], layers=layers, stacked=stacked)
    raise KeyError(f"no HF name known for parameter {'.'.join(map(str, path))}")


def hf_shapes(kind: LayoutKind, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Shapes of the HF tensors behind one (per-layer) parameter of ours of `shape`."""
    if kind == "copy":
        return (shape,)
    if kind == "transpose":
        return (shape[::-1],)
    if kind == "heads_out":
        n, h, e = shape
        return ((e, n * h),)
    if kind == "qkv_in":
        e, k, j, h = shape
        return ((k * (j - 2) * h, e), (k * h, e), (k * h, e))
    if kind == "qkv_bias":
        k, j, h = shape
        return ((k * (j - 2) * h,), (k * h,), (k * h,))
    if kind == "experts_pair_in":
        x, e, _, f = shape
        return ((f, e),) * (2 * x)
    if kind == "experts_transpose":
        x, f, e = shape
        return ((e, f),) * x
    e, _, f = shape
    return ((f, e), (f, e))


def to_ours(kind: LayoutKind, reads: tuple[ReadFn, ...], index: Index, head_dim: int,
            group: int) -> np.ndarray:
    """Our array's `index` (normalised slices, step 1) read from the HF tensors via `reads`
    (one per part, in `hf_shapes` order); `group`: query heads per kv head.

    Head-split layouts read whole heads (rows `n0*H : n1*H`) and slice `head_dim` after the
    reshape: the HF rows of one head are contiguous, the head_dim slice within them is not.
    """
    if kind == "copy":
        return reads[0](index)
    if kind == "transpose":
        return reads[0](index[::-1]).T
    if kind == "heads_out":
        sn, sh, se = index
        block = reads[0]((se, _heads(sn, head_dim)))
        return block.T.reshape(-1, head_dim, block.shape[0])[:, sh, :]
    if kind == "pair_in":
        se, sc, sf = index
        return np.stack([reads[c]((sf, se)).T for c in range(2)[sc]], axis=1)
    if kind == "experts_pair_in":  # reads: gate_0, up_0, gate_1, up_1, ...
        sx, se, sc, sf = index
        return np.stack([to_ours("pair_in", reads[2 * x:2 * x + 2], (se, sc, sf), head_dim, group)
                         for x in range(len(reads) // 2)[sx]])
    if kind == "experts_transpose":
        sx, sf, se = index
        return np.stack([reads[x]((se, sf)).T for x in range(len(reads))[sx]])
    if kind == "qkv_in":
        se, sk, sj, sh = index
        parts = [p.T.reshape(p.shape[1], sk.stop - sk.start, -1, head_dim)
                 for p in _qkv_rows(reads, sk, head_dim, group, lambda rows: (rows, se))]
        return np.concatenate(parts, axis=2)[:, :, sj, sh]
    sk, sj, sh = index
    parts = [p.reshape(sk.stop - sk.start, -1, head_dim)
             for p in _qkv_rows(reads, sk, head_dim, group, lambda rows: (rows,))]
    return np.concatenate(parts, axis=1)[:, sj, sh]


def _qkv_rows(reads: tuple[ReadFn, ...], sk: slice, head_dim: int, group: int,
              index: Callable[[slice], Index]) -> list[np.ndarray]:
    """The HF rows of kv heads `sk`: their G query heads' (contiguous: query head k*G + g),
    then their keys', then their values'."""
    q_rows = slice(sk.start * group * head_dim, sk.stop * group * head_dim)
    return [reads[0](index(q_rows)), reads[1](index(_heads(sk, head_dim))),
            reads[2](index(_heads(sk, head_dim)))]


def to_hf(kind: LayoutKind, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """Inverse of `to_ours` for a whole (per-layer) array: one array per HF part."""
    if kind == "copy":
        return (x,)
    if kind == "transpose":
        return (x.T,)
    if kind == "heads_out":
        return (x.reshape(-1, x.shape[-1]).T,)
    if kind == "pair_in":
        return (x[:, 0].T, x[:, 1].T)
    if kind == "experts_pair_in":
        return tuple(part for expert in x for part in to_hf("pair_in", expert))
    if kind == "experts_transpose":
        return tuple(expert.T for expert in x)
    if kind == "qkv_in":
        e, group = x.shape[0], x.shape[2] - 2
        return (x[:, :, :group].reshape(e, -1).T, x[:, :, group].reshape(e, -1).T,
                x[:, :, group + 1].reshape(e, -1).T)
    group = x.shape[1] - 2
    return (x[:, :group].reshape(-1), x[:, group].reshape(-1), x[:, group + 1].reshape(-1))


def _heads(s: slice, head_dim: int) -> slice:
    return slice(s.start * head_dim, s.stop * head_dim)
