"""`dense`: the values and gradients of jnp.einsum and its autodiff (its backward pass is
written by hand), for each projection shape the model uses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.dense import dense

SPECS = {  # spec: (x shape, w shape)
    "bte,ecf->btcf": ((3, 5, 8), (8, 2, 6)),  # gate/up: expanding, x narrower than dy
    "btf,fe->bte": ((3, 5, 12), (12, 8)),  # down: dy narrower than x
    "btnh,nhe->bte": ((3, 5, 4, 2), (4, 2, 8)),  # o: two contracted axes
    "bce,ev->bcv": ((2, 3, 8), (8, 16)),  # the output projection
}


def _operands(spec, seed=0):
    x_shape, w_shape = SPECS[spec]
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    return jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape), kd


@pytest.mark.parametrize("spec", SPECS)
def test_dense_is_einsum_with_its_gradients(spec):
    x, w, kd = _operands(spec)
    want, pullback = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x, w)
    got, pullback_dense = jax.vjp(lambda x, w: dense(x, w, spec), x, w)
    dy = jax.random.normal(kd, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(pullback_dense(dy), pullback(dy), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dense_keeps_the_preferred_output_type():
    x, w, _ = _operands("bce,ev->bcv")
    y = dense(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), "bce,ev->bcv", jnp.float32)
    assert y.dtype == jnp.float32
    dx, dw = jax.grad(lambda x, w: jnp.sum(dense(x, w, "bce,ev->bcv", jnp.float32)),
                      argnums=(0, 1))(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert dx.dtype == dw.dtype == jnp.bfloat16
