import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl import (
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
    zero_std_frac,
    zero_std_groups,
)

# Two prompts, G = 4, prompt-major: group 0 = [1, 0, 0, 1], group 1 = [2, 0, 1, 1].
REWARDS = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 1.0, 1.0])


def test_grpo_group_scale_uses_the_sample_std():
    # Group 0: mean 0.5, sample std sqrt((4 x 0.25) / 3) = 0.57735 (population std would be
    #   0.5); A = +-0.5 / (0.57735 + 1e-4) = +-0.86588.
    # Group 1: mean 1, deviations [1, -1, 0, 0], sample std sqrt(2 / 3) = 0.81650;
    #   A = +-1 / 0.81660 = +-1.22460.
    adv = grpo_advantages(REWARDS, 4, "group")
    np.testing.assert_allclose(
        adv, [0.86588, -0.86588, -0.86588, 0.86588, 1.22460, -1.22460, 0.0, 0.0], atol=2e-5)


def test_grpo_batch_scale_is_the_std_of_all_rewards():
    # Batch mean 6 / 8 = 0.75; squared deviations 0.0625 x 4 + 0.5625 x 3 + 1.5625 = 3.5;
    #   sample std sqrt(3.5 / 7) = 0.70711. Numerators are r - *group* mean:
    #   group 0 +-0.5 / 0.70721 = +-0.70701, group 1 +-1 / 0.70721 = +-1.41401.
    adv = grpo_advantages(REWARDS, 4, "batch")
    np.testing.assert_allclose(
        adv, [0.70701, -0.70701, -0.70701, 0.70701, 1.41401, -1.41401, 0.0, 0.0], atol=2e-5)


def test_grpo_no_scale_and_dr_grpo_are_the_centred_rewards():
    # r - group mean: group 0 mean 0.5, group 1 mean 1.
    want = [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]
    np.testing.assert_allclose(grpo_advantages(REWARDS, 4, "none"), want, atol=1e-7)
    np.testing.assert_allclose(dr_grpo_advantages(REWARDS, 4), want, atol=1e-7)


def test_rloo_subtracts_the_mean_of_the_others():
    # Group 0: r = 1 -> others [0, 0, 1], mean 1/3, A = 2/3; r = 0 -> others [1, 0, 1], A = -2/3.
    # Group 1: r = 2 -> others [0, 1, 1], A = 2 - 2/3 = 4/3; r = 0 -> others [2, 1, 1],
    #   A = -4/3; r = 1 -> others [2, 0, 1], mean 1, A = 0.
    np.testing.assert_allclose(
        rloo_advantages(REWARDS, 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0, 0],
        atol=1e-6)


def test_matches_numpy_sample_std_on_random_rewards():
    r = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
    centred = r - r.mean(axis=1, keepdims=True)
    want = centred / (r.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    got = grpo_advantages(jnp.asarray(r.reshape(-1)), 6, "group")
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=1e-5)
    # RLOO is the centred reward scaled by G / (G - 1).
    np.testing.assert_allclose(rloo_advantages(jnp.asarray(r.reshape(-1)), 6),
                               (centred * 6 / 5).reshape(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [
    lambda r: grpo_advantages(r, 4, "group"), lambda r: grpo_advantages(r, 4, "batch"),
    lambda r: grpo_advantages(r, 4, "none"), lambda r: rloo_advantages(r, 4),
    lambda r: dr_grpo_advantages(r, 4)])
def test_jit_equals_eager_and_groups_sum_to_zero(fn):
    np.testing.assert_allclose(jax.jit(fn)(REWARDS), fn(REWARDS), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(fn(REWARDS).reshape(2, 4).sum(axis=1), 0.0, atol=1e-6)
    assert fn(REWARDS).dtype == jnp.float32


def test_zero_std_groups_are_masked_and_counted():
    # G = 2: [0.1, 0.1] equal (exactly, though their float mean need not be 0.1), [1, 0]
    # not, [5, 5] equal -> 2 of 3 groups.
    rewards = jnp.array([0.1, 0.1, 1.0, 0.0, 5.0, 5.0])
    np.testing.assert_array_equal(zero_std_groups(rewards, 2),
                                  [True, True, False, False, True, True])
    np.testing.assert_allclose(zero_std_frac(rewards, 2), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(zero_std_frac, static_argnums=1)(rewards, 2), 2 / 3,
                               rtol=1e-6)
    # Their advantages are 0 under every estimator (the std division gives 0 / eps = 0).
    np.testing.assert_allclose(grpo_advantages(rewards, 2, "group")[jnp.array([0, 1, 4, 5])],
                               0.0, atol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        grpo_advantages(REWARDS, 1)
    with pytest.raises(ValueError, match="group_size=3"):
        rloo_advantages(REWARDS, 3)
    with pytest.raises(ValueError, match="scale_rewards.*'std'"):
        grpo_advantages(REWARDS, 4, "std")
