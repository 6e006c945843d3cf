"""GAE, whitening, explained variance and the clipped value loss against numbers worked out
by hand (jaxrl.rl.gae's docstring has the equations)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.gae import explained_variance, gae_advantages, value_loss, whiten

# Row 0: three valid tokens, reward 1. Row 1: two valid tokens then padding, reward 0.5
# (its third value is garbage: it must not matter).
REWARDS = jnp.array([1.0, 0.5])
VALUES = jnp.array([[0.2, 0.4, 0.6], [0.1, 0.3, 99.0]])
MASK = jnp.array([[1, 1, 1], [1, 1, 0]], bool)


def test_gae_by_hand():
    # gamma 0.9, lambda 0.8: gamma·lambda = 0.72.
    # Row 0, reward 1 at t = 2:
    #   t=2: delta = 1 + 0 - 0.6 = 0.4                 A = 0.4
    #   t=1: delta = 0 + 0.9·0.6 - 0.4 = 0.14          A = 0.14 + 0.72·0.4 = 0.428
    #   t=0: delta = 0 + 0.9·0.4 - 0.2 = 0.16          A = 0.16 + 0.72·0.428 = 0.46816
    #   returns A + V = 0.66816, 0.828, 1.0
    # Row 1, reward 0.5 at t = 1 (the last valid token), t = 2 is padding:
    #   t=1: delta = 0.5 - 0.3 = 0.2                   A = 0.2
    #   t=0: delta = 0.9·0.3 - 0.1 = 0.17              A = 0.17 + 0.72·0.2 = 0.314
    #   returns 0.414, 0.5; padding 0, 0
    adv, returns = gae_advantages(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv, [[0.46816, 0.428, 0.4], [0.314, 0.2, 0.0]], atol=1e-6)
    np.testing.assert_allclose(returns, [[0.66816, 0.828, 1.0], [0.414, 0.5, 0.0]], atol=1e-6)


def test_gae_with_gamma_and_lambda_one_is_the_reward_minus_the_value():
    # Monte-Carlo: A_t = R - V_t, every return is the sequence reward.
    adv, returns = gae_advantages(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [[0.8, 0.6, 0.4], [0.4, 0.2, 0.0]], atol=1e-6)
    np.testing.assert_allclose(returns, [[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]], atol=1e-6)


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    adv, _ = gae_advantages(REWARDS, VALUES, MASK, gamma=0.9, lam=0.0)
    np.testing.assert_allclose(adv, [[0.16, 0.14, 0.4], [0.17, 0.2, 0.0]], atol=1e-6)


def test_gae_jits_and_an_empty_row_is_all_zero():
    mask = jnp.array([[1, 1, 1], [0, 0, 0]], bool)
    adv, returns = jax.jit(gae_advantages, static_argnums=(3, 4))(REWARDS, VALUES, mask,
                                                                   0.9, 0.8)
    np.testing.assert_array_equal(adv[1], 0.0)
    np.testing.assert_array_equal(returns[1], 0.0)
    np.testing.assert_allclose(adv[0], [0.46816, 0.428, 0.4], atol=1e-6)


def test_whiten_over_valid_tokens_only():
    # [1, 2, 3]: mean 2, population std sqrt(2/3) = 0.81650 -> -1.22474, 0, 1.22474.
    x = jnp.array([[1.0, 2.0], [3.0, 100.0]])
    out = whiten(x, jnp.array([[1, 1], [1, 0]], bool))
    np.testing.assert_allclose(out, [[-1.22474, 0.0], [1.22474, 0.0]], atol=1e-5)


def test_explained_variance_by_hand():
    # G = [1, 1, 3]: mean 5/3, Var = (4/9 + 4/9 + 16/9) / 3 = 8/9.
    # G - V = [1, 0, 1]: mean 2/3, Var = (1/9 + 4/9 + 1/9) / 3 = 2/9.  EV = 1 - 1/4 = 0.75.
    values = jnp.array([[0.0, 1.0, 2.0, -7.0]])
    returns = jnp.array([[1.0, 1.0, 3.0, 5.0]])
    mask = jnp.array([[1, 1, 1, 0]], bool)
    assert float(explained_variance(values, returns, mask)) == pytest.approx(0.75, abs=1e-6)
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    # Constant returns: no variance to explain, 0 rather than a division by zero.
    assert float(explained_variance(values, jnp.ones((1, 4)), mask)) == 0.0


# Three tokens, eps_v = 0.2:
#   V 0.5, V_old 0.4, G 1: V_clip = 0.5;  (0.5-1)^2 = 0.25 both        -> 0.25, not clipped
#   V 0.9, V_old 0.4, G 1: V_clip = 0.6;  0.01 vs (0.6-1)^2 = 0.16     -> 0.16, clipped larger
#   V 1.0, V_old 0.4, G 0: V_clip = 0.6;  1 vs 0.36                    -> 1, not clipped
# loss = 1/2 · (0.25 + 0.16 + 1) / 3 = 0.235, clip_frac 1/3.
V = jnp.array([[0.5, 0.9, 1.0, 3.0]])
V_OLD = jnp.array([[0.4, 0.4, 0.4, 3.0]])
G = jnp.array([[1.0, 1.0, 0.0, -4.0]])
VMASK = jnp.array([[1, 1, 1, 0]], bool)


def test_clipped_value_loss_by_hand():
    loss, metrics = value_loss(V, V_OLD, G, VMASK, 0.2, "token_mean")
    assert float(loss) == pytest.approx(0.235, abs=1e-6)
    assert float(metrics["value/loss"]) == pytest.approx(0.235, abs=1e-6)
    assert float(metrics["value/clip_frac"]) == pytest.approx(1 / 3, abs=1e-6)
    # Unclipped: 1/2 · (0.25 + 0.01 + 1) / 3 = 0.21.
    loss, metrics = value_loss(V, V_OLD, G, VMASK, None, "token_mean")
    assert float(loss) == pytest.approx(0.21, abs=1e-6)
    assert float(metrics["value/clip_frac"]) == 0.0


def test_clipped_value_loss_gradient_by_hand():
    # d/dV of 1/2 (V - G)^2 / 3 = (V - G) / 3 on the unclipped branch; the clipped branch of
    # token 1 is saturated (V - V_old = 0.5 > 0.2): no gradient; padding: none.
    grad = jax.grad(lambda v: value_loss(v, V_OLD, G, VMASK, 0.2, "token_mean")[0])(V)
    np.testing.assert_allclose(grad, [[-0.5 / 3, 0.0, 1.0 / 3, 0.0]], atol=1e-6)


def test_value_loss_aggregations_and_whole_batch_counts():
    values = jnp.array([[1.0, 1.0], [2.0, 0.0]])
    returns = jnp.zeros((2, 2))
    mask = jnp.array([[1, 1], [1, 0]], bool)
    # Per token 1/2 V^2: [0.5, 0.5], [2, -]. seq_mean_token_mean: (0.5 + 2) / 2 = 1.25;
    # seq_mean_token_sum_norm (C = 2): (1/2 + 2/2) / 2 = 0.75; token_mean: 3 / 3 = 1.
    for aggregation, expected in (("seq_mean_token_mean", 1.25),
                                  ("seq_mean_token_sum_norm", 0.75), ("token_mean", 1.0)):
        loss, _ = value_loss(values, values, returns, mask, None, aggregation,
                             max_completion_len=2)
        assert float(loss) == pytest.approx(expected), aggregation
    # Two microbatches normalised by the whole batch's counts sum to the batch's loss.
    parts = [value_loss(values[i:i + 1], values[i:i + 1], returns[i:i + 1], mask[i:i + 1],
                        None, "token_mean", num_tokens=3, num_seqs=2)[0] for i in range(2)]
    assert float(sum(parts)) == pytest.approx(1.0)
