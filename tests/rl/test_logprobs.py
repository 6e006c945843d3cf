import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl import chunked_log_probs_and_entropy, token_entropy, token_log_probs


def test_log_probs_and_entropy_by_hand():
    # Row 0: logits ln[1, 2, 3] -> p = [1/6, 2/6, 3/6]; target 2 -> logp = ln(1/2) = -0.6931;
    #   H = (1/6)ln6 + (1/3)ln3 + (1/2)ln2 = 0.2986 + 0.3662 + 0.3466 = 1.0114.
    # Row 1: logits [0, 0, 0] -> p uniform; logp = -ln3 = -1.0986; H = ln3 = 1.0986.
    logits = jnp.array([[[0.0, math.log(2), math.log(3)], [0.0, 0.0, 0.0]]])
    targets = jnp.array([[2, 1]])
    np.testing.assert_allclose(token_log_probs(logits, targets), [[-0.693147, -1.098612]],
                               rtol=1e-6)
    np.testing.assert_allclose(token_entropy(logits), [[1.011404, 1.098612]], rtol=1e-6)


def test_temperature_divides_the_logits():
    # T = 2: logits ln[1, 2, 3] / 2 -> weights [1, sqrt2, sqrt3], sum 1 + 1.41421 + 1.73205 =
    #   4.14626; target 0 -> logp = -ln 4.14626 = -1.42221.
    logits = jnp.array([[[0.0, math.log(2), math.log(3)]]])
    logp = token_log_probs(logits, jnp.array([[0]]), temperature=2.0)
    np.testing.assert_allclose(logp, [[-1.422208]], rtol=1e-5)
    np.testing.assert_allclose(token_entropy(logits, temperature=2.0),
                               token_entropy(logits / 2.0), rtol=1e-6)


def test_entropy_ignores_masked_tokens():
    # A -inf logit has p = 0: [0, 0, -inf] is uniform over two tokens, H = ln2.
    logits = jnp.array([[[0.0, 0.0, -jnp.inf]]])
    np.testing.assert_allclose(token_entropy(logits), [[math.log(2)]], rtol=1e-6)
    grad = jax.grad(lambda x: token_entropy(x).sum())(logits)
    assert np.isfinite(grad).all()


def test_bf16_logits_give_float32():
    logits = jnp.zeros((1, 2, 4), jnp.bfloat16)
    assert token_log_probs(logits, jnp.zeros((1, 2), jnp.int32)).dtype == jnp.float32
    assert token_entropy(logits).dtype == jnp.float32


def _inputs(vocab=36, dtype=jnp.float32):
    kh, kw, kt = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(kh, (2, 5, 8), dtype)
    w = (jax.random.normal(kw, (8, vocab)) * 0.7).astype(dtype)
    targets = jax.random.randint(kt, (2, 5), 0, vocab)
    return hidden, w, targets


def _unchunked(hidden, w, targets, temperature):
    logits = jnp.einsum("bte,ev->btv", hidden.astype(jnp.float32), w.astype(jnp.float32))
    return (token_log_probs(logits, targets, temperature),
            token_entropy(logits, temperature))


# V = 36: 12 divides it, 7 does not (the last chunk is padded), 100 > V is one chunk.
@pytest.mark.parametrize("chunk_size", [7, 12, 100])
def test_chunked_equals_unchunked(chunk_size):
    hidden, w, targets = _inputs()
    for temperature in (1.0, 0.7):
        logp, entropy = chunked_log_probs_and_entropy(
            hidden, w, targets, temperature=temperature, chunk_size=chunk_size)
        want_logp, want_entropy = _unchunked(hidden, w, targets, temperature)
        np.testing.assert_allclose(logp, want_logp, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(entropy, want_entropy, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [8, 12])
def test_chunked_gradients_equal_unchunked(chunk_size):
    hidden, w, targets = _inputs()
    # Weights on both outputs so both enter the gradient with distinct signs and sizes.
    a = jax.random.normal(jax.random.key(1), targets.shape)

    def objective(fn):
        def f(h, w_):
            logp, entropy = fn(h, w_)
            return jnp.sum(a * logp) + jnp.sum(entropy * (1 - a))
        return jax.grad(f, argnums=(0, 1))

    got = objective(lambda h, w_: chunked_log_probs_and_entropy(
        h, w_, targets, temperature=0.7, chunk_size=chunk_size))(hidden, w)
    want = objective(lambda h, w_: _unchunked(h, w_, targets, 0.7))(hidden, w)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-5)


def test_chunked_jit_equals_eager():
    hidden, w, targets = _inputs()
    fn = jax.jit(chunked_log_probs_and_entropy, static_argnames=("chunk_size",))
    jitted = fn(hidden, w, targets, temperature=0.7, chunk_size=8)
    eager = chunked_log_probs_and_entropy(hidden, w, targets, temperature=0.7, chunk_size=8)
    for j, e in zip(jitted, eager, strict=True):
        # Equal up to float32 rounding: jit fuses the ops around the scan differently.
        np.testing.assert_allclose(j, e, atol=1e-5, rtol=1e-5)


def test_chunked_bf16_inputs_accumulate_in_float32():
    # Products of bf16 numbers are exact in float32, so a float32-accumulated bf16 matmul
    # equals the float32 matmul of the same (bf16-rounded) values.
    hidden, w, targets = _inputs(dtype=jnp.bfloat16)
    logp, entropy = chunked_log_probs_and_entropy(hidden, w, targets, chunk_size=8)
    assert logp.dtype == entropy.dtype == jnp.float32
    want_logp, want_entropy = _unchunked(hidden, w, targets, 1.0)
    np.testing.assert_allclose(logp, want_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, atol=1e-5, rtol=1e-5)


def test_chunked_gradient_never_holds_the_full_logits():
    # 256 tokens x V = 16384 float32 logits are 16 MiB; a 256-column chunk is 256 KiB. The
    # rematerialised scan body keeps the backward pass at a few chunks (~1.1 MiB on CPU, the
    # same for V = 4096), where the unchunked gradient needs 5x the full logits (80 MiB).
    hidden, w, targets = jnp.ones((4, 64, 16)), jnp.ones((16, 16384)), jnp.zeros((4, 64), int)

    def loss(h, w_):
        logp, entropy = chunked_log_probs_and_entropy(h, w_, targets, chunk_size=256)
        return jnp.sum(logp) + jnp.sum(entropy)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, w).compile()
    stats = compiled.memory_analysis()  # the CPU backend always reports it
    assert stats is not None
    assert stats.temp_size_in_bytes < 4 * 64 * 16384 * 4 / 4


def test_bad_chunk_size():
    hidden, w, targets = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_log_probs_and_entropy(hidden, w, targets, chunk_size=0)
