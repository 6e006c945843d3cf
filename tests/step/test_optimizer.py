"""The optimizer against numbers worked out by hand: the schedule, global-norm clipping seen
through Adam's first step, weight decay on matrices only, and config validation.

Adam's first step has a closed form: with m_1 = (1-b1) g and v_1 = (1-b2) g^2, the bias
corrections give m^ = g and v^ = g^2, so the update is -lr * g / (|g| + eps) per entry. With
eps = 1 that depends on the gradient's magnitude, so it shows what clipping did to it.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.config import OptimSection
from jaxrl.models import Transformer
from jaxrl.step import learning_rate_schedule, make_optimizer, weight_decay_mask
from tests.conftest import make_tiny_config

# ------------------------------------------------------------------ schedule

# lr 1e-3, 10 warmup steps, cosine to 0.1 * lr at step 110 (100 cosine steps):
# lr_t = 1e-4 + 9e-4 * (1 + cos(pi * (t - 10) / 100)) / 2 for 10 <= t <= 110.
WARMUP_COSINE = OptimSection(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)


@pytest.mark.parametrize("cfg, step, expected", [
    (WARMUP_COSINE, 0, 0.0),
    (WARMUP_COSINE, 4, 4e-4),  # 4/10 of the way up
    (WARMUP_COSINE, 10, 1e-3),  # end of warmup: the peak
    (WARMUP_COSINE, 35, 1e-4 + 9e-4 * (1 + math.sqrt(0.5)) / 2),  # a quarter: 8.682e-4
    (WARMUP_COSINE, 60, 5.5e-4),  # half way down the cosine: 1e-4 + 9e-4 / 2
    (WARMUP_COSINE, 110, 1e-4),  # total_steps: the floor
    (WARMUP_COSINE, 1000, 1e-4),  # and it stays there
    # total_steps None: constant after warmup.
    (OptimSection(lr=2e-5, warmup_steps=4), 0, 0.0),
    (OptimSection(lr=2e-5, warmup_steps=4), 2, 1e-5),
    (OptimSection(lr=2e-5, warmup_steps=4), 4, 2e-5),
    (OptimSection(lr=2e-5, warmup_steps=4), 10**6, 2e-5),
    # No warmup: the first step already has the peak rate.
    (OptimSection(lr=1e-3, total_steps=100), 0, 1e-3),
    (OptimSection(lr=1e-3, total_steps=100), 50, 5e-4),
    (OptimSection(lr=1e-3, total_steps=100), 100, 0.0),
    (OptimSection(lr=3e-4), 0, 3e-4),
])
def test_schedule_worked_values(cfg, step, expected):
    np.testing.assert_allclose(learning_rate_schedule(cfg)(step), expected, rtol=1e-6, atol=1e-12)


# ------------------------------------------------------------------ clipping

def _first_update(cfg, grads):
    params = jax.tree.map(jnp.zeros_like, grads)
    tx = make_optimizer(cfg)
    updates, state = tx.update(grads, tx.init(params), params)
    return updates, state


# Two leaves, so that only a *global* norm gives these numbers: ||(6, 8)|| = 10.
BIG = {"a": jnp.array([6.0]), "b": jnp.array([[8.0]])}
SMALL = {"a": jnp.array([0.3]), "b": jnp.array([[0.4]])}  # norm 0.5, under the cap


@pytest.mark.parametrize("max_grad_norm, grads, expected_a, expected_b", [
    # Clipped to (0.6, 0.8): -0.1 * 0.6 / 1.6 and -0.1 * 0.8 / 1.8. (Clipping each leaf to
    # norm 1 would give -0.05 for both; no clipping gives the last case's numbers.)
    (1.0, BIG, -0.0375, -0.08 / 1.8),
    (1.0, SMALL, -0.03 / 1.3, -0.04 / 1.4),  # under the cap: untouched
    (None, BIG, -0.6 / 7, -0.8 / 9),  # clipping off
])
def test_clipping_scales_the_global_norm_before_adam(max_grad_norm, grads, expected_a, expected_b):
    cfg = OptimSection(lr=0.1, eps=1.0, weight_decay=0.0, max_grad_norm=max_grad_norm)
    updates, _ = _first_update(cfg, grads)
    # fp32 roundoff (e.g. 1 - 0.9 in the bias correction) is a few 1e-6 of the result.
    np.testing.assert_allclose(updates["a"], [expected_a], rtol=1e-5)
    np.testing.assert_allclose(updates["b"], [[expected_b]], rtol=1e-5)


def test_adam_moments_see_the_clipped_gradient():
    _, state = _first_update(OptimSection(lr=0.1, max_grad_norm=1.0), BIG)
    mu = optax.tree_utils.tree_get(state, "mu")
    nu = optax.tree_utils.tree_get(state, "nu")
    # (1 - b1) * (0.6, 0.8) and (1 - b2) * (0.36, 0.64).
    np.testing.assert_allclose([mu["a"][0], mu["b"][0, 0]], [0.06, 0.08], rtol=1e-5)
    np.testing.assert_allclose([nu["a"][0], nu["b"][0, 0]], [3.6e-4, 6.4e-4], rtol=1e-5)


# ------------------------------------------------------------------ weight decay

def test_weight_decay_skips_vectors():
    # Zero gradient: Adam contributes 0, so the update is the decay alone, -lr * wd * p.
    cfg = OptimSection(lr=0.1, weight_decay=0.5)
    params = {"w": jnp.full((2, 3), 2.0), "bias": jnp.ones(3), "scale": jnp.ones(4)}
    tx = make_optimizer(cfg)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    np.testing.assert_allclose(updates["w"], np.full((2, 3), -0.1), rtol=1e-6)
    np.testing.assert_array_equal(updates["bias"], np.zeros(3))
    np.testing.assert_array_equal(updates["scale"], np.zeros(4))


@pytest.mark.parametrize("family, scan_layers", [
    ("llama", False), ("qwen2", True), ("qwen3", True),
])
def test_decay_mask_of_the_transformer(family, scan_layers):
    """Kernels, embeddings and the LM head are matrices; norm scales (also the stacked
    [layers, embed] ones of the layer scan, and q/k-norm's [head_dim]) and biases (also the
    [heads, head_dim] q/k/v biases) are vectors, as in the Hugging Face checkpoint."""
    config = make_tiny_config(family, scan_layers=scan_layers)
    params = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    mask = weight_decay_mask(params)
    names = [(jax.tree_util.keystr(path), leaf) for path, leaf in
             jax.tree_util.tree_leaves_with_path(params)]
    flags = jax.tree.leaves(mask)
    assert len(flags) == len(names)
    for (name, leaf), decayed in zip(names, flags, strict=True):
        is_vector = "['scale']" in name or "_bias']" in name
        assert decayed == (not is_vector), (name, leaf.shape)
    assert any(flags) and not all(flags)
    if scan_layers:  # the case a dimension count would get wrong
        assert any(len(leaf.shape) >= 2 and not d for (_, leaf), d in zip(names, flags, strict=True))


# ------------------------------------------------------------------ config validation

