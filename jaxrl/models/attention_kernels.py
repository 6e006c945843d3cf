"""The non-XLA attention kernels of the uncached forward, their preconditions, and which runs.

`attention_impl` picks one per platform (`resolve_attention_impl`): "auto" is cuDNN flash
attention on GPU (bf16/fp16 compute), Splash attention (Pallas) on TPU, XLA's own
attention (`attention.grouped_attention`) elsewhere. Every kernel computes, for the
left-padded rows of the training forward (`valid[b]` = 0...0 1...1, then completion tokens
whose tail may be masked after EOS),

    out[b, t] = sum_s softmax_s(scale · q[b, t] · k[b, s] | s <= t, t - s < window, valid[b, s]) v[b, s]

for every real query t; padding queries get finite garbage that callers mask. It is
`grouped_attention` under `attention.causal_mask`, restricted to the real query rows.

cuDNN (`cudnn_attention`): jax's cuDNN path takes causal, window and per-row *lengths* from
position 0, not an arbitrary boolean mask (that becomes a dense [B, 1, T, S] bias). So row b
is rotated left by its p_b leading pads (q, k, v after RoPE, so positions are unchanged):
real query t lands at i = t - p_b, key s at j = s - p_b, and the causal mask j <= i with
window i - j < w is exactly s <= t, t - s < w. A real query never reads past itself, and its
keys p_b..t are all real *provided the real tokens of a row are contiguous* (left pads, real
tokens, then only invalid ones: `phases.update_batch` concatenates the left-padded prompt mask
and the completion mask, which is 1 up to EOS and 0 after). The p_b pads wrapped to the end
sit after every real query, so no sequence lengths are needed; each rotated query row
attends at least to its own key, so no row is empty and no output is NaN. The output is
rotated back. The same rotation runs with `implementation="xla"` on any platform, which is
how the CPU tests prove it against `grouped_attention`; that cuDNN computes what jax's XLA
path does for is_causal and local_window_size is what benchmarks/gpu_attention.py checks.

Splash (`splash_attention`): the padding is a segment id (pad 0, real 1) and the kernel ANDs
"same segment" with a causal (or local-window) mask, so no contiguity is needed; padding
queries attend to padding keys, at least to themselves. Splash works on one example at a
time ([heads, T, H]; GQA by q heads per kv head): it is vmapped over rows and, under
`use_rules`, wrapped in a shard_map over the batch and kv-head mesh axes (a Pallas call is
not partitioned by XLA). It needs T a multiple of 128 (its block sizes) and the sequence and
head_dim unsharded; where a call does not meet that, the XLA path runs instead and a
warning says why, once per reason. It runs on CPU in Pallas interpret mode (jax 0.10.2),
which is how the tests check it; its speed on TPU is unmeasured here. The block size (the
largest of 512, 256, 128 dividing T) follows the kernel's defaults, not a TPU measurement.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl.sharding.rules import active_rules

# The platform each kernel runs on (jax.default_backend() / Device.platform names).
KERNEL_PLATFORMS = {"cudnn": "gpu", "splash": "tpu"}
CUDNN_DTYPES = ("bfloat16", "float16")
SPLASH_BLOCKS = (512, 256, 128)


class PaddedRows(NamedTuple):
    """The uncached forward's self-attention mask, given as its rows' real tokens.

    Stands for `attention.causal_mask(valid_BxT, sliding_window)`; the kernels take it in
    this form (offsets or segment ids), the XLA fallback expands it.
    """

    valid_BxT: jax.Array


def resolve_attention_impl(impl: str, *, platform: str, compute_dtype: str,
                           head_dim: int) -> str:
    """The kernel that `impl` means on `platform`; a choice that cannot run there is an error.

    "auto": cuDNN on GPU when the compute dtype is bf16/fp16 and head_dim fits it, Splash on
    TPU, else XLA. An explicit "cudnn" or "splash" is checked, never silently replaced.
    """
    platform = "gpu" if platform == "cuda" else platform
    cudnn_problem = _cudnn_problem(compute_dtype, head_dim)
    if impl == "auto":
        if platform == "gpu" and cudnn_problem is None:
            return "cudnn"
        return "splash" if platform == "tpu" else "xla"
    expected = KERNEL_PLATFORMS.get(impl)
    if expected is not None and platform != expected:
        raise ValueError(
            f"attention_impl={impl!r} runs on {expected.upper()} only, but the platform is "
            f"{platform!r}; use 'auto' (cudnn on GPU, splash on TPU, xla elsewhere) or 'xla'")
    if impl == "cudnn" and cudnn_problem is not None:
        raise ValueError(f"attention_impl='cudnn' {cudnn_problem}; use 'auto' or 'xla'")
    return impl


def _cudnn_problem(compute_dtype: str, head_dim: int) -> str | None:
    # jax/_src/cudnn/fused_attention_stablehlo.py: check_layout, check_is_flash_attention
    # (head_dim <= 128 before Hopper, which cuDNN reports itself).
    if compute_dtype not in CUDNN_DTYPES:
        return f"needs compute_dtype bfloat16 or float16, got {compute_dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"needs head_dim a multiple of 8 and <= 256, got {head_dim}"
    return None


def check_platform(impl: str) -> None:
    """At trace time: a kernel is traced only for the platform it runs on."""
    expected = KERNEL_PLATFORMS[impl]
    if jax.default_backend() != expected:
        raise ValueError(f"attention_impl={impl!r} runs on {expected.upper()} only, but "
                         f"the default backend is {jax.default_backend()!r}")


def leading_pads(valid_BxT: jax.Array) -> jax.Array:
    """p[b] = the number of invalid tokens before row b's first real one (T if none)."""
    return jnp.sum(jnp.cumsum(valid_BxT.astype(jnp.int32), axis=1) == 0, axis=1)


def roll_rows(x_BxTx: jax.Array, shift_B: jax.Array) -> jax.Array:
    """y[b, i] = x[b, (i + shift[b]) mod T]: row b rotated left by shift[b]."""
    t = x_BxTx.shape[1]
    index_BxT = (jnp.arange(t)[None, :] + shift_B[:, None]) % t
    index = index_BxT.reshape(index_BxT.shape + (1,) * (x_BxTx.ndim - 2))
    return jnp.take_along_axis(x_BxTx, index, axis=1)


def cudnn_attention(q_BxTxKxGxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                    valid_BxT: jax.Array, *, scale: float, sliding_window: int | None,
                    implementation: str = "cudnn") -> jax.Array:
    """Causal self-attention of left-padded rows through `jax.nn.dot_product_attention`'s
    is_causal path (module docstring): rotate out the leading pads, attend, rotate back.

    Precondition: each row's real tokens are contiguous. `implementation="xla"` runs the
    same rotation through jax's XLA attention (any platform; the tests).
    """
    if implementation == "cudnn":
        check_platform("cudnn")
    b, t, k, g, h = q_BxTxKxGxH.shape
    pads_B = leading_pads(valid_BxT)
    q_BxTxNxH = roll_rows(q_BxTxKxGxH.reshape(b, t, k * g, h), pads_B)
    out_BxTxNxH = jax.nn.dot_product_attention(
        q_BxTxNxH, roll_rows(k_BxTxKxH, pads_B), roll_rows(v_BxTxKxH, pads_B), scale=scale,
        is_causal=True,
        local_window_size=None if sliding_window is None else (sliding_window - 1, 0),
        implementation=implementation)
    return roll_rows(out_BxTxNxH, t - pads_B).reshape(b, t, k, g, h)


def splash_segment_ids(valid_BxT: jax.Array) -> jax.Array:
    """Splash segment ids: 1 for a real token, 0 for padding (attends only to padding)."""
    return valid_BxT.astype(jnp.int32)


def splash_block(seq_len: int) -> int | None:
    """The Splash block size for sequences of `seq_len` tokens; None if none divides it."""
    return next((b for b in SPLASH_BLOCKS if seq_len % b == 0), None)


def splash_attention(q_BxTxKxGxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                     valid_BxT: jax.Array, *, scale: float, sliding_window: int | None,
                     interpret: bool = False) -> jax.Array | None:
    """Causal self-attention of padded rows by Splash attention (module docstring), or None
    (after a one-time warning) where its preconditions do not hold: the caller runs XLA's.

    `interpret=True` runs the Pallas kernel in interpret mode (any platform; the tests).
    """
    if not interpret:
        check_platform("splash")
    t = q_BxTxKxGxH.shape[1]
    block = splash_block(t)
    if block is None:
        return _fallback(f"sequence length {t} is not a multiple of {SPLASH_BLOCKS[-1]}")
    _, _, k, g, _ = q_BxTxKxGxH.shape
    active = active_rules()
    if active is None:
        kernel = _splash_kernel(t, k * g, sliding_window, block, interpret)
        return _splash_rows(kernel, q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, valid_BxT, scale)
    mesh, rules = active
    q_spec = tuple(rules.spec(("batch", "seq", "act_kv_heads", None, "head_dim"),
                              q_BxTxKxGxH.shape, mesh))
    q_spec += (None,) * (5 - len(q_spec))
    if any(q_spec[i] is not None for i in (1, 3, 4)):
        return _fallback(f"the sharding rules split the sequence or head_dim ({q_spec})")
    batch, heads = q_spec[0], q_spec[2]
    head_axes = () if heads is None else (heads,) if isinstance(heads, str) else heads
    head_shards = math.prod(mesh.shape[a] for a in head_axes)
    # Made out here: its mask tables would be traced values inside the shard_map.
    kernel = _splash_kernel(t, k // head_shards * g, sliding_window, block, interpret)
    return jax.shard_map(
        functools.partial(_splash_rows, kernel, scale=scale), mesh=mesh, check_vma=False,
        in_specs=(PartitionSpec(batch, None, heads), PartitionSpec(batch, None, heads),
                  PartitionSpec(batch, None, heads), PartitionSpec(batch)),
        out_specs=PartitionSpec(batch, None, heads),
    )(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, valid_BxT)


def _splash_rows(kernel, q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, valid_BxT, scale):
    """`kernel` over the (local) rows: [B, T, K, G, H] -> per row [N, T, H], vmapped."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, t, k, g, h = q_BxTxKxGxH.shape
    # Splash does not scale the scores: scale q (exact when head_dim is a power of 4).
    q_BxNxTxH = (q_BxTxKxGxH * scale).astype(q_BxTxKxGxH.dtype).transpose(0, 2, 3, 1, 4)
    segments_BxT = splash_segment_ids(valid_BxT)

    def one_row(q_NxTxH, k_KxTxH, v_KxTxH, segments_T):
        return kernel(q_NxTxH, k_KxTxH, v_KxTxH, segment_ids=SegmentIds(segments_T, segments_T))

    out_BxNxTxH = jax.vmap(one_row)(q_BxNxTxH.reshape(b, k * g, t, h),
                                    k_BxTxKxH.transpose(0, 2, 1, 3),
                                    v_BxTxKxH.transpose(0, 2, 1, 3), segments_BxT)
    return out_BxNxTxH.reshape(b, k, g, t, h).transpose(0, 3, 1, 2, 4)


@functools.lru_cache(maxsize=16)
def _splash_kernel(seq_len: int, num_heads: int, sliding_window: int | None, block: int,
                   interpret: bool):
    """A Splash kernel for [num_heads, T, H] queries: causal, or causal within the window."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (seq_len, seq_len)
    if sliding_window is None:
        head_mask = splash.CausalMask(shape)
    else:  # t - window < s <= t
        head_mask = splash.LocalMask(shape, window_size=(sliding_window - 1, 0), offset=0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    # Its mask tables become arrays: concrete ones, so the cached kernel outlives this trace.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha_single_device(
            splash.MultiHeadMask([head_mask] * num_heads), block_sizes=sizes,
            interpret=interpret)


def _fallback(reason: str) -> None:
    # warnings shows each distinct message once (per call site), which is the intent.
    warnings.warn(f"attention_impl='splash' falls back to XLA attention: {reason}",
                  stacklevel=3)
    return None

