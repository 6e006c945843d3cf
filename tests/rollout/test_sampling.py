"""Per-token sampling: allowed sets of top-k / top-p worked out in numpy, log-probs, frequencies."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rollout import SamplingParams, process_logits, sample_tokens

ROWS, VOCAB, DRAWS = 64, 24, 16
# Float32 (sampler) against float64 (numpy) mass near the top-p boundary.
MASS_TOL = 1e-5

_sample = jax.jit(sample_tokens, static_argnums=2)
_process = jax.jit(process_logits, static_argnums=1)


def _random_logits(seed):
    """ROWS rows of logits, flat to very peaked; every fourth row has many exact ties."""
    rng = np.random.default_rng(seed)
    scale_R1 = rng.choice([0.1, 1.0, 3.0, 10.0], size=(ROWS, 1))
    logits_RxV = (rng.standard_normal((ROWS, VOCAB)) * scale_R1).astype(np.float32)
    logits_RxV[::4] = np.round(logits_RxV[::4])
    return logits_RxV


def _draw(seed, logits_RxV, params):
    """DRAWS samples per row, each with its own key: (tokens, logp, logp_raw), [DRAWS * ROWS]."""
    logits_BxV = np.tile(logits_RxV, (DRAWS, 1))
    keys_B = jax.random.split(jax.random.key(seed), logits_BxV.shape[0])
    return tuple(np.asarray(x) for x in _sample(keys_B, jnp.asarray(logits_BxV), params))


def _scaled(logits_BxV, temperature):
    # The same float32 division the sampler does, so ties and order are identical.
    return logits_BxV.astype(np.float32) / np.float32(temperature)


def _top_k_allowed(logits_BxV, k):
    kth_B1 = np.sort(logits_BxV, axis=-1)[:, ::-1][:, k - 1:k]
    return logits_BxV >= kth_B1


def _top_p_allowed(logits_BxV, p, mass_slack):
    """Tokens at least as likely as the last one of the smallest sorted prefix with mass >= p.

    `mass_slack` moves the target mass to p + slack, so +-MASS_TOL bracket the exact set.
    """
    x = logits_BxV.astype(np.float64)
    probs_BxV = np.exp(x - x.max(-1, keepdims=True))
    probs_BxV /= probs_BxV.sum(-1, keepdims=True)
    order_BxV = np.argsort(-x, axis=-1, kind="stable")
    mass_BxV = np.cumsum(np.take_along_axis(probs_BxV, order_BxV, -1), axis=-1)
    last_B = np.minimum((mass_BxV < p + mass_slack).sum(-1), x.shape[-1] - 1)
    threshold_B1 = np.take_along_axis(x, order_BxV, -1)[np.arange(len(x)), last_B][:, None]
    return x >= threshold_B1


def _masked(logits_BxV, allowed_BxV):
    return np.where(allowed_BxV, logits_BxV, -np.inf)


def _log_softmax(x_BxV):
    x = x_BxV.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _take(values_BxV, token_B):
    return values_BxV[np.arange(len(token_B)), token_B]


def _check_draws(seed, logits_RxV, params, scaled_RxV, strict_RxV, loose_RxV):
    """strict <= kept set <= loose; tokens are kept; logp is the renormalised kept set."""
    kept_RxV = np.isfinite(np.asarray(_process(jnp.asarray(logits_RxV), params)))
    assert np.all(kept_RxV >= strict_RxV) and np.all(kept_RxV <= loose_RxV)
    token_B, logp_B, logp_raw_B = _draw(seed, logits_RxV, params)
    tile = lambda x: np.tile(x, (DRAWS, 1))  # noqa: E731
    assert np.all(_take(tile(kept_RxV), token_B))
    filtered_BxV = tile(_masked(scaled_RxV, kept_RxV))
    np.testing.assert_allclose(logp_B, _take(_log_softmax(filtered_BxV), token_B), atol=1e-5)
    np.testing.assert_allclose(logp_raw_B, _take(_log_softmax(tile(logits_RxV)), token_B),
                               atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_draws_only_from_the_k_largest(seed, k):
    logits_RxV = _random_logits(seed)
    scaled_RxV = _scaled(logits_RxV, 0.8)
    allowed_RxV = _top_k_allowed(scaled_RxV, k)
    _check_draws(seed, logits_RxV, SamplingParams(0.8, top_k=k), scaled_RxV, allowed_RxV,
                 allowed_RxV)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_draws_only_from_the_smallest_prefix_reaching_p(seed, p):
    logits_RxV = _random_logits(seed)
    scaled_RxV = _scaled(logits_RxV, 1.3)
    strict_RxV = _top_p_allowed(scaled_RxV, p, -MASS_TOL)
    loose_RxV = _top_p_allowed(scaled_RxV, p, MASS_TOL)
    _check_draws(seed, logits_RxV, SamplingParams(1.3, top_p=p), scaled_RxV, strict_RxV,
                 loose_RxV)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k, p", [(5, 0.6), (12, 0.95), (2, 0.999)])
def test_top_k_then_top_p(seed, k, p):
    """Top-p measures mass under the top-k distribution renormalised (as transformers does)."""
    logits_RxV = _random_logits(seed)
    scaled_RxV = _scaled(logits_RxV, 0.7)
    top_k_RxV = _masked(scaled_RxV, _top_k_allowed(scaled_RxV, k))
    strict_RxV = _top_p_allowed(top_k_RxV, p, -MASS_TOL)
    loose_RxV = _top_p_allowed(top_k_RxV, p, MASS_TOL)
    _check_draws(seed, logits_RxV, SamplingParams(0.7, top_k=k, top_p=p), scaled_RxV,
                 strict_RxV & np.isfinite(top_k_RxV), loose_RxV & np.isfinite(top_k_RxV))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_log_probs(seed, temperature):
    logits_RxV = _random_logits(seed)
    token_B, logp_B, logp_raw_B = _draw(seed, logits_RxV, SamplingParams(temperature))
    logits_BxV = np.tile(logits_RxV, (DRAWS, 1))
    np.testing.assert_allclose(
        logp_B, _take(_log_softmax(logits_BxV / temperature), token_B), atol=1e-5)
    np.testing.assert_allclose(logp_raw_B, _take(_log_softmax(logits_BxV), token_B), atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_argmax_with_zero_log_prob(seed):
    logits_RxV = _random_logits(seed)
    token_B, logp_B, logp_raw_B = _draw(seed, logits_RxV, SamplingParams(0.0, top_k=3))
    logits_BxV = np.tile(logits_RxV, (DRAWS, 1))
    np.testing.assert_array_equal(token_B, logits_BxV.argmax(-1))
    np.testing.assert_array_equal(logp_B, 0.0)
    np.testing.assert_allclose(logp_raw_B, _take(_log_softmax(logits_BxV), token_B), atol=1e-5)


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(1.0), [0.5, 0.25, 0.15, 0.1]),
    # softmax(log p / T) is proportional to p ** (1 / T).
    (SamplingParams(0.5), np.array([0.5, 0.25, 0.15, 0.1]) ** 2 / 0.345),
    (SamplingParams(1.0, top_k=2), [2 / 3, 1 / 3, 0, 0]),
    # Mass before the third token is 0.75 >= 0.7: the first two are kept.
    (SamplingParams(1.0, top_p=0.7), [2 / 3, 1 / 3, 0, 0]),
    (SamplingParams(1.0, top_k=3, top_p=0.95), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),
])
def test_empirical_frequencies_match_the_distribution(params, expected):
    n = 40_000
    logits_NxV = jnp.broadcast_to(jnp.log(jnp.array([0.5, 0.25, 0.15, 0.1])), (n, 4))
    token_N = np.asarray(_sample(jax.random.split(jax.random.key(3), n), logits_NxV, params)[0])
    freq_V = np.bincount(token_N, minlength=4) / n
    expected = np.asarray(expected)
    stderr_V = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq_V - expected) <= 5 * stderr_V + 1e-12), (freq_V, expected)


def test_each_row_draws_with_its_own_key():
    """Permuting rows (logits and keys together) permutes the draws: rows are independent."""
    logits_RxV = jnp.asarray(_random_logits(0))
    keys_R = jax.random.split(jax.random.key(1), ROWS)
    perm_R = np.random.default_rng(0).permutation(ROWS)
    params = SamplingParams(1.0, top_p=0.9)
    token_R = np.asarray(_sample(keys_R, logits_RxV, params)[0])
    permuted_R = np.asarray(_sample(keys_R[perm_R], logits_RxV[perm_R], params)[0])
    np.testing.assert_array_equal(permuted_R, token_R[perm_R])


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
    (dict(temperature=math.nan), "temperature must be >= 0, got nan"),
    (dict(top_k=0), "top_k must be >= 1 or null, got 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\] or null, got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\] or null, got 1.5"),
])
def test_invalid_params_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_the_sampled_distribution_is_the_models_only_when_nothing_changes_it():
    """Temperature 1 and no filter: one log-softmax serves both log-probs, the same numbers."""
    from jaxrl.rollout.sampling import unchanged

    assert unchanged(SamplingParams(1.0), VOCAB)
    assert unchanged(SamplingParams(1.0, top_k=VOCAB, top_p=1.0), VOCAB)
    assert not unchanged(SamplingParams(0.7), VOCAB)
    assert not unchanged(SamplingParams(1.0, top_k=VOCAB - 1), VOCAB)
    assert not unchanged(SamplingParams(1.0, top_p=0.9), VOCAB)
    _, logp_B, logp_raw_B = _draw(0, _random_logits(0), SamplingParams(1.0))
    np.testing.assert_array_equal(logp_B, logp_raw_B)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k, p", [(1, 0.5), (3, 0.9), (10, 0.7), (VOCAB - 1, 0.95)])
def test_top_p_after_top_k_sorts_only_the_k_and_keeps_the_same_tokens(seed, k, p):
    """Top-p from top-k's k sorted values (ties of the k-th in the normaliser) keeps exactly
    what top-p over the whole sorted, top-k-filtered vocabulary keeps; no vocabulary sort."""
    logits_RxV = jnp.asarray(_random_logits(seed))
    params = SamplingParams(0.7, top_k=k, top_p=p)
    both_RxV = _process(logits_RxV, params)
    top_k_RxV = _process(logits_RxV, SamplingParams(0.7, top_k=k))
    reference_RxV = _process(top_k_RxV, SamplingParams(1.0, top_p=p))
    np.testing.assert_array_equal(np.isfinite(both_RxV), np.isfinite(reference_RxV))
    np.testing.assert_array_equal(np.asarray(both_RxV)[np.isfinite(both_RxV)],
                                  np.asarray(reference_RxV)[np.isfinite(reference_RxV)])
    lowered = jax.jit(process_logits, static_argnums=1).lower(logits_RxV, params).as_text()
    assert "stablehlo.sort" not in lowered  # top_k is its own op (a kernel on GPU/TPU)


def test_categorical_draws_the_token_jax_random_categorical_draws():
    """Same keys, same tokens: including ties (rounded rows), -inf (filtered) logits, bf16."""
    from jaxrl.rollout.sampling import categorical
    logits_RxV = _random_logits(7)
    logits_RxV[1::4, ::3] = -np.inf
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(logits_RxV, dtype)
        for seed in range(4):
            keys = jax.random.split(jax.random.key(seed), ROWS)
            want = jax.vmap(jax.random.categorical)(keys, x)
            np.testing.assert_array_equal(jax.jit(categorical)(keys, x), want)
