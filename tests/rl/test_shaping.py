import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl import overlong_penalty


def test_overlong_penalty_by_hand():
    # max_len 20, cache_len 4: free up to 20 - 4 = 16, then (16 - L) / 4, then -1.
    # L = 10, 16 -> 0;  17 -> -1/4;  18 -> -2/4;  20 -> -4/4 = -1;  25 -> -1.
    lengths = jnp.array([10, 16, 17, 18, 20, 25])
    want = [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 4), want, atol=1e-7)
    jitted = jax.jit(overlong_penalty, static_argnums=(1, 2))(lengths, 20, 4)
    np.testing.assert_allclose(jitted, want, atol=1e-7)
    assert jitted.dtype == jnp.float32


def test_cache_equal_to_max_len_starts_the_ramp_at_zero():
    # max_len = cache_len = 4: -L / 4 for every L <= 4.
    np.testing.assert_allclose(overlong_penalty(jnp.array([0, 1, 4, 5]), 4, 4),
                               [0.0, -0.25, -1.0, -1.0], atol=1e-7)


@pytest.mark.parametrize(("max_len", "cache_len", "message"), [
    (0, 1, "max_len must be >= 1, got 0"), (10, 0, "cache_len .*got 0"),
    (10, 11, "cache_len must be in \\[1, max_len=10\\], got 11")])
def test_bad_lengths(max_len, cache_len, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty(jnp.array([1]), max_len, cache_len)
