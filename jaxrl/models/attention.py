"""Grouped-query self-attention with rotary positions, optional q/k/v bias and q/k RMSNorm.

The same module serves the training forward (attend within the given tokens) and the
sampler's cached path (write this call's keys/values into a preallocated cache at slot
`end`, then attend over the whole cache). Masks are built once per forward by
`causal_mask` / `cache_causal_mask` and shared by every layer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.attention_kernels import PaddedRows, cudnn_attention, splash_attention
from jaxrl.models.config import ModelConfig
from jaxrl.models.dense import dense
from jaxrl.models.layers import RMSNorm, apply_rope, normal, param
from jaxrl.models.lora import make_adapters
from jaxrl.models.lora_config import ATTENTION_MODULES
from jaxrl.models.paged_attention import ragged_decode_attention, write_token_kv
from jaxrl.sharding import constrain


def causal_mask(valid_BxT: jax.Array, sliding_window: int | None) -> jax.Array:
    """mask[b, t, s] = s <= t and valid[b, s] (and t - s < window), plus the diagonal.

    Keeping the diagonal lets padding queries attend to themselves, so no softmax row is
    empty (their outputs are garbage that callers mask, never NaN).
    """
    t = jnp.arange(valid_BxT.shape[1])
    return _mask(valid_BxT, t, t, sliding_window)


def cache_causal_mask(cache_valid_BxS: jax.Array, end: jax.Array, num_new: int,
                         sliding_window: int | None) -> jax.Array:
    """Mask of `num_new` queries written at cache slots [end, end + num_new) over all slots."""
    return _mask(cache_valid_BxS, end + jnp.arange(num_new),
                 jnp.arange(cache_valid_BxS.shape[1]), sliding_window)


def segment_causal_mask(segments_BxT: jax.Array, sliding_window: int | None) -> jax.Array:
    """mask[b, t, s] = s <= t and seg[b, s] = seg[b, t] > 0 (and t - s < window), plus the
    diagonal: packed rows (`jaxrl.step.packing`), several sequences one after another in a
    row, segment 0 the padding; no token attends across a segment."""
    t = jnp.arange(segments_BxT.shape[1])
    same_BxTxS = (segments_BxT[:, :, None] == segments_BxT[:, None, :]) & \
        (segments_BxT > 0)[:, None, :]
    return _mask(same_BxTxS, t, t, sliding_window)


def _mask(valid_BxS, query_slots_T, key_slots_S, sliding_window):
    q, k = query_slots_T[:, None], key_slots_S[None, :]
    allowed_TxS = k <= q
    if sliding_window is not None:
        allowed_TxS &= q - k < sliding_window
    valid = valid_BxS.astype(bool)
    # valid [B, S]: which keys are real; or [B, T, S] per query (`segment_causal_mask`).
    mask_BxTxS = allowed_TxS[None] & (valid if valid.ndim == 3 else valid[:, None, :])
    return mask_BxTxS | (q == k)[None]


class PagedKV(NamedTuple):
    """A decode step's view of the paged KV pool (`jaxrl.models.paged_attention`).

    `kv_pages` [layers, pages, page_size, 2*kv_heads, head_dim] (keys and values interleaved
    on the head axis); slot s writes its new token at (`write_page_S[s]`, `write_offset_S[s]`)
    (a page out of range writes nothing) and attends over its first `length_S[s]` tokens,
    found through `page_table_SxM`. `layer` is filled in per layer; `unroll`: the XLA
    path's block loop unrolled over every block (FLOP accounting; the same outputs).
    """

    kv_pages: jax.Array
    page_table_SxM: jax.Array
    length_S: jax.Array
    write_page_S: jax.Array
    write_offset_S: jax.Array
    impl: str = "xla"
    pages_per_block: int = 8
    layer: jax.Array | int = 0
    unroll: bool = False


class Attention(nnx.Module):
    """softmax(q k^T / sqrt(head_dim) + mask) v with num_heads / num_kv_heads query groups.

    q, k and v come from one projection: the kernel [E, K, G+2, H] holds, for each of the K
    kv heads, its G = N/K query heads, its key and its value (`hf_names` splits and merges
    it at the HF boundary). Grouping by kv head keeps a kv head's queries, key and value on
    the same shard when `kv_heads` is split over a mesh axis; where that axis does not divide
    K (2 kv heads on a 4-way tensor axis) the whole projection is replicated over it.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        e, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        g = n // k
        self.config = config
        # Drawn as three kernels in HF's order (the random init a seed gives is unchanged).
        q_ExKxGxH = normal(rngs, (e, n, h), config).reshape(e, k, g, h)
        k_ExKx1xH, v_ExKx1xH = (normal(rngs, (e, k, h), config)[:, :, None] for _ in "kv")
        self.qkv_kernel = param(jnp.concatenate([q_ExKxGxH, k_ExKx1xH, v_ExKx1xH], axis=2),
                                ("embed", "kv_heads", "qkv", "head_dim"))
        self.o_kernel = param(normal(rngs, (n, h, e), config), ("heads", "head_dim", "embed"))
        if config.qkv_bias:
            self.qkv_bias = param(jnp.zeros((k, g + 2, h), config.param_dtype),
                                  ("kv_heads", "qkv", "head_dim"))
        if config.o_bias:
            self.o_bias = param(jnp.zeros((e,), config.param_dtype), ("embed",))
        if config.qk_norm:
            self.q_norm = RMSNorm(h, "head_dim", config.rms_norm_eps, config)
            self.k_norm = RMSNorm(h, "head_dim", config.rms_norm_eps, config)
        # Drawn after the base (which a seed then draws as without adapters).
        self.lora = make_adapters(ATTENTION_MODULES, config, rngs)

    def _project(self, x_BxTxE):
        """(q [B, T, K, G, H], k [B, T, K, H], v [B, T, K, H]) from one matmul."""
        dt = self.config.compute_dtype
        qkv_BxTxKxJxH = dense(x_BxTxE, self.qkv_kernel[...].astype(dt), "bte,ekjh->btkjh")
        if self.config.qkv_bias:
            qkv_BxTxKxJxH = qkv_BxTxKxJxH + self.qkv_bias[...].astype(dt)
        g = qkv_BxTxKxJxH.shape[3] - 2
        if self.lora is not None:
            qkv_BxTxKxJxH = qkv_BxTxKxJxH + self._lora_qkv(x_BxTxE, qkv_BxTxKxJxH.shape)
        return (qkv_BxTxKxJxH[:, :, :, :g], qkv_BxTxKxJxH[:, :, :, g],
                qkv_BxTxKxJxH[:, :, :, g + 1])

    def _lora_qkv(self, x_BxTxE, shape):
        """The adapters' s · (x A) B of q, k and v in the fused [B, T, K, G+2, H] layout."""
        b, t, k, j, h = shape
        dt = self.config.compute_dtype
        parts = []
        for module, size in (("q_proj", j - 2), ("k_proj", 1), ("v_proj", 1)):
            delta = self.lora.delta(module, x_BxTxE, dt)
            parts.append(jnp.zeros((b, t, k, size, h), dt) if delta is None
                         else delta.reshape(b, t, k, size, h))
        return jnp.concatenate(parts, axis=3)

    def __call__(
        self,
        x_BxTxE: jax.Array,
        positions_BxT: jax.Array,
        inv_freq_H2: jax.Array,
        mask_BxTxS: jax.Array | PaddedRows,
        cache: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Output, and with `cache=(k_LxBxSxKxH, v_LxBxSxKxH, layer, end)` the updated k, v;
        with `cache=PagedKV` (one token per row) the updated page pool. Without a cache the
        mask may be `PaddedRows` (the rows' real tokens), which the configured kernel takes."""
        cfg = self.config
        q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH = self._qkv(x_BxTxE, positions_BxT, inv_freq_H2)
        if isinstance(cache, PagedKV):
            return self._paged(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, cache)
        new_cache = None
        if cache is not None:
            # Write into the stacked cache of all layers so XLA updates one buffer in place.
            k_cache, v_cache, layer, end = cache
            start = (layer, 0, end, 0, 0)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k_BxTxKxH[None].astype(k_cache.dtype), start)
            v_cache = jax.lax.dynamic_update_slice(v_cache, v_BxTxKxH[None].astype(v_cache.dtype), start)
            new_cache = (k_cache, v_cache)
            k_BxTxKxH = k_cache[layer].astype(cfg.compute_dtype)
            v_BxTxKxH = v_cache[layer].astype(cfg.compute_dtype)
        kv_axes = ("batch", "cache_seq" if cache is not None else "seq", "act_kv_heads", "head_dim")
        k_BxSxKxH = constrain(k_BxTxKxH, kv_axes)
        v_BxSxKxH = constrain(v_BxTxKxH, kv_axes)
        with jax.named_scope("attention"):  # how `jaxrl.perf.profile` finds it in a trace
            out_BxTxKxGxH = self._attend(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS)
        return self._output(out_BxTxKxGxH), new_cache

    def _qkv(self, x_BxTxE, positions_BxT, inv_freq_H2):
        """q [B, T, K, G, H] and k, v [B, T, K, H], normed (qk_norm) and rotated."""
        q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH = self._project(x_BxTxE)
        if self.config.qk_norm:
            q_BxTxKxGxH = self.q_norm(q_BxTxKxGxH)
            k_BxTxKxH = self.k_norm(k_BxTxKxH)
        q_BxTxKxGxH = constrain(apply_rope(q_BxTxKxGxH, positions_BxT, inv_freq_H2),
                                ("batch", "seq", "act_kv_heads", None, "head_dim"))
        return q_BxTxKxGxH, apply_rope(k_BxTxKxH, positions_BxT, inv_freq_H2), v_BxTxKxH

    def shared_prompt(self, x_NxPxE: jax.Array, x_BxCxE: jax.Array, positions_NxP: jax.Array,
                      positions_BxC: jax.Array, inv_freq_H2: jax.Array, mask_NxPxP: jax.Array,
                      mask_BxCxS: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Outputs of N prompts and of B = N·G continuations, row b continuing prompt b // G.

        The prompts attend among themselves (`mask_NxPxP`); each continuation's queries attend
        over its prompt's keys and values (computed once, repeated G times) followed by its
        own (`mask_BxCxS`, S = P + C): the numbers of the rows prompt ⊕ continuation run
        whole, with the prompt's projections done once per group instead of G times.
        """
        g = x_BxCxE.shape[0] // x_NxPxE.shape[0]
        q_NxPxKxGxH, k_NxPxKxH, v_NxPxKxH = self._qkv(x_NxPxE, positions_NxP, inv_freq_H2)
        q_BxCxKxGxH, k_BxCxKxH, v_BxCxKxH = self._qkv(x_BxCxE, positions_BxC, inv_freq_H2)
        kv_axes = ("batch", "seq", "act_kv_heads", "head_dim")
        k_BxSxKxH, v_BxSxKxH = (
            constrain(jnp.concatenate([jnp.repeat(prompt, g, axis=0), own], axis=1), kv_axes)
            for prompt, own in ((k_NxPxKxH, k_BxCxKxH), (v_NxPxKxH, v_BxCxKxH)))
        scale = self.config.head_dim ** -0.5
        with jax.named_scope("attention"):
            out_NxPxKxGxH = grouped_attention(q_NxPxKxGxH, k_NxPxKxH, v_NxPxKxH, mask_NxPxP,
                                              scale)
            out_BxCxKxGxH = grouped_attention(q_BxCxKxGxH, k_BxSxKxH, v_BxSxKxH, mask_BxCxS,
                                              scale)
        return self._output(out_NxPxKxGxH), self._output(out_BxCxKxGxH)

    def _attend(self, q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, mask):
        """The configured kernel for the uncached forward (`mask` given as `PaddedRows`),
        XLA's attention for a dense mask (the cached path) or where Splash cannot run."""
        cfg, scale = self.config, self.config.head_dim ** -0.5
        if not isinstance(mask, PaddedRows):
            return grouped_attention(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, mask, scale)
        if cfg.attention_impl == "cudnn":
            return cudnn_attention(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, mask.valid_BxT,
                                   scale=scale, sliding_window=cfg.sliding_window)
        out_BxTxKxGxH = None
        if cfg.attention_impl == "splash":
            out_BxTxKxGxH = splash_attention(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, mask.valid_BxT,
                                             scale=scale, sliding_window=cfg.sliding_window)
        if out_BxTxKxGxH is None:
            out_BxTxKxGxH = grouped_attention(
                q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH,
                causal_mask(mask.valid_BxT, cfg.sliding_window), scale)
        return out_BxTxKxGxH

    def _output(self, out_BxTxKxGxH):
        """The output projection as one 2-D contraction over the heads' features (n·h): with
        n and h as two contracted axes XLA:CPU matches their order to the decode attention's
        layout by transposing the whole o kernel in every decode step (benchmarks/README.md,
        "Fourth sitting"); a flat axis fixes the order at no cost (a bitcast)."""
        cfg = self.config
        b, t, k, g, h = out_BxTxKxGxH.shape
        out_BxTxE = dense(out_BxTxKxGxH.reshape(b, t, k * g * h),
                          self.o_kernel[...].astype(cfg.compute_dtype).reshape(k * g * h, -1),
                          "btf,fe->bte")
        if self.lora is not None:
            delta_BxTxE = self.lora.delta("o_proj", out_BxTxKxGxH.reshape(b, t, k * g * h),
                                          cfg.compute_dtype)
            if delta_BxTxE is not None:
                out_BxTxE = out_BxTxE + delta_BxTxE
        if cfg.o_bias:
            out_BxTxE = out_BxTxE + self.o_bias[...].astype(cfg.compute_dtype)
        return out_BxTxE

    def _paged(self, q_Sx1xKxGxH, k_Sx1xKxH, v_Sx1xKxH, paged: PagedKV):
        """One token per slot: write its k/v into its page, attend over its live pages."""
        if q_Sx1xKxGxH.shape[1] != 1:
            raise ValueError(f"paged attention decodes one token per row, got "
                             f"{q_Sx1xKxGxH.shape[1]}")
        s, _, k, g, h = q_Sx1xKxGxH.shape
        kv_pages = write_token_kv(paged.kv_pages, paged.layer, k_Sx1xKxH[:, 0], v_Sx1xKxH[:, 0],
                                  paged.write_page_S, paged.write_offset_S)
        with jax.named_scope("attention"):
            out_SxNxH = ragged_decode_attention(
                q_Sx1xKxGxH.reshape(s, k * g, h), kv_pages, paged.layer, paged.page_table_SxM,
                paged.length_S, scale=self.config.head_dim ** -0.5,
                sliding_window=self.config.sliding_window,
                pages_per_block=paged.pages_per_block, impl=paged.impl, unroll=paged.unroll)
        out_Sx1xKxGxH = out_SxNxH.reshape(s, 1, k, g, h).astype(self.config.compute_dtype)
        return self._output(out_Sx1xKxGxH), kv_pages


def grouped_attention(q_BxTxKxGxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                      mask_BxTxS: jax.Array, scale: float) -> jax.Array:
    """out[b, t, k, g] = sum_s softmax_s(scale · q[b, t, k, g] · k[b, s, k] | mask) v[b, s, k].

    The XLA path, in the grouped layout the projection produces (no reshape of q to N heads
    and back); the numbers of `jax.nn.dot_product_attention`'s XLA path: scores and softmax
    in float32, masked scores at a large finite negative (a fully masked row would be
    uniform, never NaN; callers keep the diagonal), the weighted sum in the values' dtype.
    """
    scores_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                                  preferred_element_type=jnp.float32) * scale
    scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS,
                                 _MASKED_SCORE)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs_BxKxGxTxS, v_BxSxKxH)


_MASKED_SCORE = -0.7 * float(jnp.finfo(jnp.float32).max)  # jax.nn's: exp underflows to 0
