"""Which HF tensor each of our parameters comes from, and how the layouts differ.

A torch `Linear` stores its weight as [out, in]; we store kernels as [in, out] with the head
axis split out: q/k/v kernels are [E, N, H] where HF has [N*H, E], the output kernel is
[N, H, E] where HF has [E, N*H]. Each `Layout` converts a full HF tensor to ours and back,
and — for loading onto a mesh — turns a slice of *our* array into the (contiguous) slice of
the HF tensor that holds it, so each device reads only its shard from disk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import numpy as np

LayoutKind = Literal["copy", "transpose", "heads_in", "heads_out", "heads_bias"]

# Our parameter path (inside a layer for `model.layers.{i}.` names) -> (HF name, layout).
_TOP = {
    ("embed",): ("model.embed_tokens.weight", "copy"),
    ("final_norm", "scale"): ("model.norm.weight", "copy"),
    ("lm_head",): ("lm_head.weight", "transpose"),
}
_LAYER = {
    ("attn_norm", "scale"): ("input_layernorm.weight", "copy"),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", "copy"),
    ("attn", "q_kernel"): ("self_attn.q_proj.weight", "heads_in"),
    ("attn", "k_kernel"): ("self_attn.k_proj.weight", "heads_in"),
    ("attn", "v_kernel"): ("self_attn.v_proj.weight", "heads_in"),
    ("attn", "o_kernel"): ("self_attn.o_proj.weight", "heads_out"),
    ("attn", "q_bias"): ("self_attn.q_proj.bias", "heads_bias"),
    ("attn", "k_bias"): ("self_attn.k_proj.bias", "heads_bias"),
    ("attn", "v_bias"): ("self_attn.v_proj.bias", "heads_bias"),
    ("attn", "o_bias"): ("self_attn.o_proj.bias", "copy"),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", "copy"),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", "copy"),
    ("mlp", "gate"): ("mlp.gate_proj.weight", "transpose"),
    ("mlp", "up"): ("mlp.up_proj.weight", "transpose"),
    ("mlp", "down"): ("mlp.down_proj.weight", "transpose"),
}

Index = tuple[slice, ...]
ReadFn = Callable[[Index], np.ndarray]  # reads a slice of the HF tensor


@dataclasses.dataclass(frozen=True)
class ParamName:
    """Where one of our variables lives in an HF checkpoint.

    `layers` is None for a top-level parameter, the layer indices for a per-layer one; with
    `stacked` (scan_layers) our array has a leading layer axis holding all of them.
    """

    template: str
    kind: LayoutKind
    layers: tuple[int, ...] | None
    stacked: bool

    def hf_names(self) -> list[str]:
        if self.layers is None:
            return [self.template]
        return [f"model.layers.{i}.{self.template}" for i in self.layers]


def param_name(path: tuple[str | int, ...], num_layers: int) -> ParamName:
    """The HF name(s) of the variable at NNX state `path` (`layers.3.attn.q_kernel` ...)."""
    if path in _TOP:
        return ParamName(*_TOP[path], layers=None, stacked=False)
    if path[0] == "layers":
        if isinstance(path[1], int):
            layers, stacked, inner = (path[1],), False, path[2:]
        else:
            layers, stacked, inner = tuple(range(num_layers)), True, path[1:]
        if inner in _LAYER:
            return ParamName(*_LAYER[inner], layers=layers, stacked=stacked)
    raise KeyError(f"no HF name known for parameter {'.'.join(map(str, path))}")


def hf_shape(kind: LayoutKind, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the HF tensor behind one (per-layer) parameter of ours of `shape`."""
    if kind == "copy":
        return shape
    if kind == "transpose":
        return shape[::-1]
    if kind == "heads_in":
        e, n, h = shape
        return (n * h, e)
    if kind == "heads_out":
        n, h, e = shape
        return (e, n * h)
    (n, h) = shape
    return (n * h,)


def to_ours(kind: LayoutKind, read: ReadFn, index: Index, head_dim: int) -> np.ndarray:
    """Our array's `index` (normalised slices, step 1) read from the HF tensor via `read`.

    Head-split layouts read whole heads (rows `n0*H : n1*H`) and slice `head_dim` after the
    reshape: the HF rows of one head are contiguous, the head_dim slice within them is not.
    """
    if kind == "copy":
        return read(index)
    if kind == "transpose":
        return read(index[::-1]).T
    if kind == "heads_in":
        se, sn, sh = index
        block = read((_heads(sn, head_dim), se))
        return block.T.reshape(block.shape[1], -1, head_dim)[:, :, sh]
    if kind == "heads_out":
        sn, sh, se = index
        block = read((se, _heads(sn, head_dim)))
        return block.T.reshape(-1, head_dim, block.shape[0])[:, sh, :]
    sn, sh = index
    return read((_heads(sn, head_dim),)).reshape(-1, head_dim)[:, sh]


def to_hf(kind: LayoutKind, x: np.ndarray) -> np.ndarray:
    """Inverse of `to_ours` for a whole (per-layer) array."""
    if kind == "copy":
        return x
    if kind == "transpose":
        return x.T
    if kind == "heads_in":
        return x.reshape(x.shape[0], -1).T
    if kind == "heads_out":
        return x.reshape(-1, x.shape[-1]).T
    return x.reshape(-1)


def _heads(s: slice, head_dim: int) -> slice:
    return slice(s.start * head_dim, s.stop * head_dim)
