"""The attention kernels against XLA's attention (`grouped_attention` under `causal_mask`).

cuDNN cannot run here: its left-pad rotation runs through jax's XLA attention with the same
is_causal / local_window_size arguments, which proves the rotation; that cuDNN computes
what that path computes is benchmarks/gpu_attention.py's check on a GPU. Splash runs in
Pallas interpret mode. Outputs are compared on real query rows (padding rows are garbage
that callers mask, but must be finite); gradients of a loss over real rows everywhere.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

from jaxrl.models import Transformer, attention
from jaxrl.models import attention_kernels as kernels
from jaxrl.models.attention import causal_mask, grouped_attention
from jaxrl.models.config import ModelConfig, tiny_config
from jaxrl.sharding import AxisRules, use_rules

# Left pads and ends (exclusive) of the real tokens: full rows, pads, a right tail masked
# after EOS, one real token, none.
PADS = np.array([0, 3, 1, 5, 11, 12])
ENDS = np.array([12, 10, 12, 9, 12, 12])
TOL = {"float32": 2e-6, "bfloat16": 1e-2}


def _valid(pads, ends, seq):
    t = np.arange(seq)[None]
    return jnp.asarray((t >= np.asarray(pads)[:, None]) & (t < np.asarray(ends)[:, None]))


def _qkv(b, t, k, g, h, dtype, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, t, k, g, h)).astype(dtype),
            jax.random.normal(kk, (b, t, k, h)).astype(dtype),
            jax.random.normal(kv, (b, t, k, h)).astype(dtype))


def _reference(valid_BxT, window):
    def attend(q, k, v):
        return grouped_attention(q, k, v, causal_mask(valid_BxT, window), q.shape[-1] ** -0.5)
    return attend


def _assert_matches(kernel, reference, qkv, valid_BxT, tol):
    """Forward on real rows, and d/d(q, k, v) of a loss over real rows, within tol x max."""
    out, ref = (np.asarray(f(*qkv), np.float32) for f in (kernel, reference))
    assert np.isfinite(out).all()
    real = np.asarray(valid_BxT)
    np.testing.assert_allclose(out[real], ref[real], atol=tol * np.abs(ref[real]).max(), rtol=0)

    cotangent = jax.random.normal(jax.random.key(7), out.shape) * real[:, :, None, None, None]

    def grads(f):
        loss = lambda *qkv: jnp.sum(f(*qkv).astype(jnp.float32) * cotangent)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*qkv)

    for got, want in zip(grads(kernel), grads(reference), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)


# ------------------------------------------------------------------ which kernel runs

@pytest.mark.parametrize("impl, platform, dtype, head_dim, expected", [
    ("auto", "gpu", "bfloat16", 128, "cudnn"),
    ("auto", "cuda", "float16", 64, "cudnn"),
    ("auto", "gpu", "float32", 128, "xla"),  # cuDNN flash attention is bf16/fp16 only
    ("auto", "gpu", "bfloat16", 12, "xla"),  # head_dim not a multiple of 8
    ("auto", "tpu", "float32", 64, "splash"),
    ("auto", "cpu", "bfloat16", 128, "xla"),
    ("xla", "gpu", "bfloat16", 128, "xla"),
    ("cudnn", "gpu", "bfloat16", 128, "cudnn"),
    ("splash", "tpu", "bfloat16", 128, "splash"),
])
def test_resolve_attention_impl(impl, platform, dtype, head_dim, expected):
    assert kernels.resolve_attention_impl(impl, platform=platform, compute_dtype=dtype,
                                          head_dim=head_dim) == expected


@pytest.mark.parametrize("impl, platform, dtype, words", [
    ("cudnn", "cpu", "bfloat16", ("'cudnn'", "GPU", "'cpu'")),
    ("cudnn", "tpu", "bfloat16", ("'cudnn'", "GPU", "'tpu'")),
    ("splash", "gpu", "bfloat16", ("'splash'", "TPU", "'gpu'")),
    ("cudnn", "gpu", "float32", ("'cudnn'", "bfloat16 or float16", "float32")),
])
def test_a_kernel_that_cannot_run_is_an_error_naming_it(impl, platform, dtype, words):
    with pytest.raises(ValueError) as e:
        kernels.resolve_attention_impl(impl, platform=platform, compute_dtype=dtype,
                                       head_dim=64)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_model_config_resolves_auto_for_the_default_backend():
    assert tiny_config("qwen2").attention_impl == "xla"  # CPU
    assert tiny_config("qwen2", attention_impl="cudnn").attention_impl == "cudnn"
    with pytest.raises(ValueError, match="'flash'"):
        tiny_config("qwen2", attention_impl="flash")


def test_cudnn_traced_on_cpu_is_an_error_naming_the_backend():
    q, k, v = _qkv(2, 4, 1, 1, 8, jnp.bfloat16)
    with pytest.raises(ValueError, match="'cudnn' runs on GPU only.*'cpu'"):
        kernels.cudnn_attention(q, k, v, jnp.ones((2, 4), bool), scale=1.0, sliding_window=None)


# ------------------------------------------------------------------ cuDNN's rotation

def test_leading_pads_and_roll_rows():
    valid = _valid(PADS, ENDS, 12)
    np.testing.assert_array_equal(kernels.leading_pads(valid), PADS)
    x = jnp.arange(6 * 12).reshape(6, 12)
    rolled = kernels.roll_rows(x, jnp.asarray(PADS))
    np.testing.assert_array_equal(rolled, np.stack([np.roll(r, -p) for r, p in zip(x, PADS, strict=True)]))
    np.testing.assert_array_equal(kernels.roll_rows(rolled, 12 - jnp.asarray(PADS)), x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (1, 4)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("window", [None, 3])
def test_rotated_causal_attention_matches_xla_with_our_mask(dtype, heads, window):
    valid = _valid(PADS, ENDS, 12)
    qkv = _qkv(len(PADS), 12, *heads, 8, dtype)
    kernel = functools.partial(kernels.cudnn_attention, valid_BxT=valid,
                               scale=8 ** -0.5, sliding_window=window, implementation="xla")
    _assert_matches(kernel, _reference(valid, window), qkv, valid, TOL[dtype])


# ------------------------------------------------------------------ Splash (interpret mode)

def test_splash_segment_ids_and_causal_mask_are_our_mask_on_real_rows():
    valid = _valid(PADS, ENDS, 12)
    segments = np.asarray(kernels.splash_segment_ids(valid))
    t = np.arange(12)
    for window in (None, 3):
        allowed = t[None, :] <= t[:, None]
        if window is not None:
            allowed &= t[:, None] - t[None, :] < window
        splash = (segments[:, :, None] == segments[:, None, :]) & allowed
        ours = np.asarray(causal_mask(valid, window))
        real = np.asarray(valid)
        np.testing.assert_array_equal(splash[real], ours[real])
        assert splash.any(-1).all()  # no empty softmax row


@pytest.mark.parametrize("window", [None, 5])
def test_splash_matches_xla_with_our_mask(window):
    pads, ends = [0, 37, 127], [128, 100, 128]
    valid = _valid(pads, ends, 128)
    qkv = _qkv(3, 128, 2, 2, 32, jnp.float32)
    kernel = functools.partial(kernels.splash_attention, valid_BxT=valid, scale=32 ** -0.5,
                               sliding_window=window, interpret=True)
    _assert_matches(kernel, _reference(valid, window), qkv, valid, TOL["float32"])


def test_splash_under_sharding_rules_runs_per_shard():
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 1, 2), ("data", "fsdp", "tensor"),
                axis_types=(AxisType.Auto,) * 3)
    rules = AxisRules.from_mapping({"batch": "data", "act_kv_heads": "tensor"})
    valid = _valid([0, 60], [128, 128], 128)
    qkv = _qkv(2, 128, 2, 2, 16, jnp.float32, seed=1)

    def kernel(*qkv):
        with use_rules(mesh, rules):
            return kernels.splash_attention(*qkv, valid, scale=16 ** -0.5, sliding_window=None,
                                            interpret=True)

    _assert_matches(kernel, _reference(valid, None), qkv, valid, TOL["float32"])


def test_splash_falls_back_with_a_warning_where_it_cannot_run():
    q, k, v = _qkv(2, 12, 1, 2, 8, jnp.float32)
    with pytest.warns(UserWarning, match="not a multiple of 128"):
        assert kernels.splash_attention(q, k, v, jnp.ones((2, 12), bool), scale=1.0,
                                        sliding_window=None, interpret=True) is None


# ------------------------------------------------------------------ through the model

@pytest.mark.parametrize("family, scan_layers, remat", [
    ("qwen2", False, "none"), ("mistral", True, "block")])
def test_model_with_the_rotation_kernel_matches_xla(monkeypatch, family, scan_layers, remat):
    """Logits on real tokens and parameter gradients: the kernel path of `Attention` (the
    rows' real tokens passed down as `PaddedRows`, through scan and remat)."""
    monkeypatch.setattr(attention, "cudnn_attention",
                        functools.partial(kernels.cudnn_attention, implementation="xla"))
    xla = tiny_config(family, attention_impl="xla", scan_layers=scan_layers, remat=remat)
    kernel = ModelConfig(**{**xla.__dict__, "attention_impl": "cudnn"})
    valid = _valid(PADS, ENDS, 12)
    ids = jax.random.randint(jax.random.key(3), valid.shape, 0, xla.vocab_size)

    def loss_and_grads(config):
        graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))

        def loss(state):
            logits = nnx.merge(graphdef, state)(ids, attention_mask=valid)
            return jnp.sum(jnp.where(valid[..., None], jax.nn.log_softmax(logits), 0)), logits
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)

    (_, logits), grads = loss_and_grads(kernel)
    (_, ref_logits), ref_grads = loss_and_grads(xla)
    real = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real],
                               atol=1e-5 * np.abs(ref_logits).max(), rtol=0)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max() + 1e-7, rtol=0)
