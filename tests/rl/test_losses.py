import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl import PolicyLossConfig, kl_estimate, policy_loss

# Two sequences of three tokens with ratios [1.5, 0.5, 1.1]; advantages +1 and -1.
RATIOS = jnp.array([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]])
OLD = jnp.full((2, 3), -1.0)
LOGP = OLD + jnp.log(RATIOS)
ADV = jnp.array([1.0, -1.0])
MASK = jnp.ones((2, 3))
DAPO = PolicyLossConfig(epsilon_low=0.2, epsilon_high=0.28)


def test_clipped_objective_by_hand():
    # clip(ratio, 0.8, 1.28) = [1.28, 0.8, 1.1].
    # A = +1: -min([1.5, 0.5, 1.1], [1.28, 0.8, 1.1]) = [-1.28, -0.5, -1.1]  (1.5 clipped)
    # A = -1: -min([-1.5, -0.5, -1.1], [-1.28, -0.8, -1.1]) = [1.5, 0.8, 1.1] (0.5 clipped)
    # token mean = (-1.28 - 0.5 - 1.1 + 1.5 + 0.8 + 1.1) / 6 = 0.52 / 6 = 0.086667
    loss, metrics = policy_loss(LOGP, OLD, ADV, MASK, DAPO)
    np.testing.assert_allclose(loss, 0.52 / 6, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss/policy"], 0.52 / 6, rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_frac"], 2 / 6, rtol=1e-6)
    assert float(metrics["loss/kl"]) == 0.0
    assert set(metrics) == {"loss/policy", "loss/kl", "clip_frac"}


def test_clipping_at_both_epsilons_stops_the_gradient_on_one_side_only():
    # d/dlogp of -ratio·A is -A·ratio where the unclipped branch is active, 0 where clipped:
    # A = +1: ratio 1.5 > 1 + eps_high -> 0; 0.5 < 1 - eps_low is *not* clipped (A > 0) -> -0.5.
    # A = -1: ratio 1.5 is not clipped (A < 0) -> 1.5; 0.5 < 1 - eps_low -> 0.
    grad = jax.grad(lambda lp: policy_loss(lp, OLD, ADV, MASK, DAPO)[0])(LOGP)
    np.testing.assert_allclose(grad, jnp.array([[0.0, -0.5, -1.1], [1.5, 0.0, 1.1]]) / 6,
                               rtol=1e-5, atol=1e-7)
    # Clip-higher: with eps_high = 0.6 the ratio 1.5 (A > 0) is no longer clipped.
    cfg = PolicyLossConfig(epsilon_low=0.2, epsilon_high=0.6)
    grad = jax.grad(lambda lp: policy_loss(lp, OLD, ADV, MASK, cfg)[0])(LOGP)
    np.testing.assert_allclose(grad[0, 0], -1.5 / 6, rtol=1e-5)


def test_masked_tokens_have_exactly_zero_gradient():
    # Garbage at a padding position (ratio e^1000 = inf if it were used) changes nothing.
    mask = MASK.at[1, 2].set(0)
    logp = LOGP.at[1, 2].set(1000.0)
    ref = OLD.at[1, 2].set(-1000.0)
    cfg = PolicyLossConfig(epsilon_low=0.2, epsilon_high=0.28, beta=0.1, entropy_coef=0.1,
                           tis_cap=2.0)

    def loss(lp):
        return policy_loss(lp, OLD, ADV, mask, cfg, ref_logp_BxT=ref, sampler_logp_BxT=ref,
                           entropy_BxT=lp)[0]

    value, grad = jax.value_and_grad(loss)(logp)
    assert np.isfinite(value) and np.isfinite(grad).all()
    assert float(grad[1, 2]) == 0.0
    np.testing.assert_allclose(value, loss(LOGP.at[1, 2].set(-3.0)), rtol=1e-6)


def test_gspo_ratio_is_the_geometric_mean_of_the_sequence():
    # Token log-ratios 0.3 and -0.1 (third token masked): sequence ratio
    # exp((0.3 - 0.1) / 2) = e^0.1 = sqrt(e^0.3 · e^-0.1) = 1.10517, on both valid tokens.
    # A = 1, no clipping: both tokens lose -e^s with s the mean log-ratio, so the loss is
    # -e^0.1 = -1.10517 and d/dlogp_t = -e^s · ds/dlogp_t = -e^0.1 / 2 = -0.552585.
    old = jnp.zeros((1, 3))
    logp = jnp.array([[0.3, -0.1, 7.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    cfg = PolicyLossConfig(epsilon_low=0.5, epsilon_high=0.5, importance_level="sequence")
    loss, grad = jax.value_and_grad(
        lambda lp: policy_loss(lp, old, jnp.ones(1), mask, cfg)[0])(logp)
    np.testing.assert_allclose(loss, -math.exp(0.1), rtol=1e-6)
    np.testing.assert_allclose(grad, [[-math.exp(0.1) / 2, -math.exp(0.1) / 2, 0.0]],
                               rtol=1e-6)
    # GSPO clip ranges are narrow: with eps_high = 0.05 < e^0.1 - 1 the whole sequence is
    # clipped (every token, including the one whose own ratio e^-0.1 < 1) and has no gradient.
    narrow = PolicyLossConfig(epsilon_low=0.05, epsilon_high=0.05, importance_level="sequence")
    loss, metrics = policy_loss(logp, old, jnp.ones(1), mask, narrow)
    np.testing.assert_allclose(loss, -1.05, rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac"], 1.0)
    grad = jax.grad(lambda lp: policy_loss(lp, old, jnp.ones(1), mask, narrow)[0])(logp)
    assert not np.any(grad)


@pytest.mark.parametrize(("aggregation", "want"), [
    # Ratio 1, so each token's loss is -A: row 0 has 1 token of -1, row 1 3 tokens of -2,
    # row 2 is fully masked (A = 5 would count if it were not ignored).
    ("token_mean", (-1 - 6) / 4),                             # -1.75: every token alike
    ("seq_mean_token_mean", (-1 + -6 / 3) / 2),               # -1.5: every sequence alike
    ("seq_mean_token_sum_norm", (-1 / 4 + -6 / 4) / 2),       # -0.875: sum / max_len = 4
])
def test_aggregations_on_unequal_lengths(aggregation, want):
    mask = jnp.array([[1.0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    logp = jnp.zeros((3, 4))
    cfg = PolicyLossConfig(aggregation=aggregation)
    loss, _ = policy_loss(logp, logp, jnp.array([1.0, 2.0, 5.0]), mask, cfg,
                          max_completion_len=4)
    np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_kl_estimators_by_hand():
    # log r = ref - logp = [-0.5, 0, 0.7]:
    # k1 = -log r = [0.5, 0, -0.7]; k2 = (log r)^2 / 2 = [0.125, 0, 0.245];
    # k3 = r - 1 - log r = [e^-0.5 - 0.5, 0, e^0.7 - 1.7] = [0.106531, 0, 0.313753].
    logp = jnp.array([[0.0, 0.0, 0.0]])
    ref = jnp.array([[-0.5, 0.0, 0.7]])
    np.testing.assert_allclose(kl_estimate(logp, ref, "k1"), [[0.5, 0.0, -0.7]], atol=1e-7)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k2"), [[0.125, 0.0, 0.245]], atol=1e-7)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k3"), [[0.106531, 0.0, 0.313753]],
                               atol=1e-6)
    x = jax.random.normal(jax.random.key(0), (1000,)) * 3
    assert float(jnp.min(kl_estimate(jnp.zeros_like(x), x, "k3"))) >= 0.0


@pytest.mark.parametrize(("estimator", "kl_mean"), [
    ("k1", (0.5 - 0.7) / 3), ("k2", (0.125 + 0.245) / 3), ("k3", (0.106531 + 0.313753) / 3)])
def test_kl_term_adds_beta_times_the_estimate(estimator, kl_mean):
    logp = jnp.zeros((1, 3))
    ref = jnp.array([[-0.5, 0.0, 0.7]])
    cfg = PolicyLossConfig(beta=0.1, kl_estimator=estimator)
    # A = 0: the policy term is 0 and the loss is beta · mean(kl).
    loss, metrics = policy_loss(logp, logp, jnp.zeros(1), jnp.ones((1, 3)), cfg,
                                ref_logp_BxT=ref)
    np.testing.assert_allclose(metrics["loss/kl"], kl_mean, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.1 * kl_mean, rtol=1e-5)


def test_entropy_bonus_lowers_the_loss_by_coef_times_entropy():
    # Valid tokens have entropy 2.0; the masked one (100) is ignored.
    mask = MASK.at[1, 2].set(0)
    entropy = jnp.full((2, 3), 2.0).at[1, 2].set(100.0)
    base, metrics = policy_loss(LOGP, OLD, ADV, mask, DAPO, entropy_BxT=entropy)
    bonus = PolicyLossConfig(epsilon_low=0.2, epsilon_high=0.28, entropy_coef=0.01)
    loss, _ = policy_loss(LOGP, OLD, ADV, mask, bonus, entropy_BxT=entropy)
    np.testing.assert_allclose(metrics["entropy"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(loss, base - 0.01 * 2.0, rtol=1e-6)
    # A schedule's coefficient for this update (traced under jit) replaces the config's.
    scheduled = jax.jit(lambda c: policy_loss(LOGP, OLD, ADV, mask, bonus, entropy_BxT=entropy,
                                              entropy_coef=c)[0])
    np.testing.assert_allclose(scheduled(0.004), base - 0.004 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(scheduled(0.0), base, rtol=1e-6)


def test_truncated_importance_sampling_weights_the_policy_term():
    # old - sampler = [ln 0.5, ln 3]: weights min([0.5, 3], cap 2) = [0.5, 2]. Ratio 1, A = 1:
    # per-token loss -1 · w = [-0.5, -2], mean -1.25; mean weight 1.25.
    old = jnp.zeros((1, 2))
    sampler = -jnp.log(jnp.array([[0.5, 3.0]]))
    cfg = PolicyLossConfig(tis_cap=2.0)
    loss, metrics = policy_loss(old, old, jnp.ones(1), jnp.ones((1, 2)), cfg,
                                sampler_logp_BxT=sampler)
    np.testing.assert_allclose(loss, -1.25, rtol=1e-6)
    np.testing.assert_allclose(metrics["tis/weight_mean"], 1.25, rtol=1e-6)


@pytest.mark.parametrize("correction,cap,loss,weight", [
    # rho = exp(old - sampler) = [0.5, 3]; ratio 1, A = 1: per-token loss -w, token mean.
    ("tis", 2.0, -(0.5 + 2.0) / 2, (0.5 + 2.0) / 2),  # truncated at the cap
    ("mis", 2.0, -(0.5 + 0.0) / 2, (0.5 + 0.0) / 2),  # the token past the cap drops
    ("decoupled", None, -(0.5 + 3.0) / 2, (0.5 + 3.0) / 2),  # the whole weight
])
def test_behaviour_corrections_by_hand(correction, cap, loss, weight):
    old = jnp.zeros((1, 2))
    sampler = -jnp.log(jnp.array([[0.5, 3.0]]))
    cfg = PolicyLossConfig(tis_cap=cap, correction=correction)
    got, metrics = policy_loss(old, old, jnp.ones(1), jnp.ones((1, 2)), cfg,
                               sampler_logp_BxT=sampler)
    np.testing.assert_allclose(got, loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["tis/weight_mean"], weight, rtol=1e-6)
    np.testing.assert_allclose(metrics["async/ratio_mean"], 1.75, rtol=1e-6)
    np.testing.assert_allclose(metrics["async/ratio_clipped_frac"], 0.5 if cap else 0.0)
    # k3 of KL(behaviour || proximal): rho - 1 - log rho, token mean.
    k3 = np.mean([0.5 - 1 - np.log(0.5), 3.0 - 1 - np.log(3.0)])
    np.testing.assert_allclose(metrics["async/kl_behaviour"], k3, rtol=1e-6)


def test_no_correction_clips_against_the_behaviour_policy():
    # correction "none": the ratio is pi / pi_sampler. logp = old = 0, sampler = ln 0.5 and
    # ln 3 -> ratios [2, 1/3]; eps 0.2, A = 1: min(r, clip(r)) = [1.2, 1/3]; mean -0.7667.
    logp = jnp.zeros((1, 2))
    sampler = jnp.log(jnp.array([[0.5, 3.0]]))
    got, metrics = policy_loss(logp, logp, jnp.ones(1), jnp.ones((1, 2)),
                               PolicyLossConfig(correction="none"), sampler_logp_BxT=sampler)
    np.testing.assert_allclose(got, -(1.2 + 1 / 3) / 2, rtol=1e-6)
    assert "tis/weight_mean" not in metrics and metrics["clip_frac"] == 0.5


@pytest.mark.parametrize("kwargs,message", [
    (dict(correction="mis"), "correction='mis' masks .*set tis_cap"),
    (dict(correction="decoupled", tis_cap=2.0), "correction='decoupled' takes no cap"),
    (dict(correction="none", tis_cap=2.0), "correction='none' takes no cap"),
    (dict(correction="is"), "correction must be one of"),
])
def test_bad_corrections_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**kwargs)


@pytest.mark.parametrize("importance_level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation",
                         ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_jit_equals_eager(importance_level, aggregation):
    cfg = PolicyLossConfig(epsilon_low=0.2, epsilon_high=0.28, importance_level=importance_level,
                           aggregation=aggregation, beta=0.05, entropy_coef=0.01, tis_cap=2.0)
    mask = MASK.at[0, 2].set(0)
    args = (LOGP, OLD, ADV, mask, cfg)
    kw = dict(ref_logp_BxT=OLD - 0.1, sampler_logp_BxT=OLD + 0.2, entropy_BxT=jnp.ones((2, 3)),
              max_completion_len=3)
    jitted = jax.jit(policy_loss, static_argnames=("cfg", "max_completion_len"))(*args, **kw)
    eager = policy_loss(*args, **kw)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 jitted, eager)


@pytest.mark.parametrize(("field", "value"), [
    ("epsilon_low", -0.1), ("epsilon_low", 1.5), ("epsilon_high", -0.1),
    ("epsilon_high", float("nan")), ("importance_level", "tok"), ("aggregation", "sum"),
    ("beta", -1.0), ("kl_estimator", "k4"), ("entropy_coef", -0.1), ("tis_cap", 0.0)])
def test_bad_config_names_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"^{field} .*got {value!r}$|^{field} .*got {value}$"):
        PolicyLossConfig(**{field: value})


@pytest.mark.parametrize(("cfg", "message"), [
    (PolicyLossConfig(beta=0.1), "beta=0.1 .*ref_logp_BxT"),
    (PolicyLossConfig(tis_cap=2.0), "tis_cap=2.0 .*sampler_logp_BxT"),
    (PolicyLossConfig(correction="decoupled"), "correction='decoupled'.*sampler_logp_BxT"),
    (PolicyLossConfig(aggregation="seq_mean_token_sum_norm"), "max_completion_len"),
    (PolicyLossConfig(entropy_coef=0.1), "entropy_coef=0.1 .*entropy_BxT"),
    (PolicyLossConfig(entropy_target=0.5), "entropy_target=0.5.*entropy_BxT"),
    (PolicyLossConfig(top_entropy_quantile=0.2), "top_entropy_quantile.*entropy_BxT"),
])
def test_missing_inputs_are_errors(cfg, message):
    with pytest.raises(ValueError, match=message):
        policy_loss(LOGP, OLD, ADV, MASK, cfg)


def test_per_token_advantages_weight_each_token():
    # PPO's GAE gives one advantage per token (shape [B, T]). A row-constant one is the
    # per-sequence loss; otherwise, by hand, with row 0's A = [+1, -1, +2], row 1's all -1:
    #   row 0: -min([1.5, -0.5, 2.2], [1.28, -0.8, 2.2]) = [-1.28, 0.8, -2.2]
    #   row 1 as in test_clipped_objective_by_hand: [1.5, 0.8, 1.1]
    #   token mean = (-1.28 + 0.8 - 2.2 + 1.5 + 0.8 + 1.1) / 6 = 0.72 / 6 = 0.12
    constant = jnp.broadcast_to(ADV[:, None], LOGP.shape)
    np.testing.assert_allclose(policy_loss(LOGP, OLD, constant, MASK, DAPO)[0],
                               policy_loss(LOGP, OLD, ADV, MASK, DAPO)[0], rtol=1e-6)
    per_token = jnp.array([[1.0, -1.0, 2.0], [-1.0, -1.0, -1.0]])
    loss, metrics = policy_loss(LOGP, OLD, per_token, MASK, DAPO)
    np.testing.assert_allclose(loss, 0.72 / 6, rtol=1e-5)
    # Clipped (strictly smaller clipped branch): row 0 tokens 0 and 1, row 1 token 1.
    np.testing.assert_allclose(metrics["clip_frac"], 3 / 6, rtol=1e-6)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(surrogate="clip"), "surrogate must be one of"),
    (dict(entropy_aggregation="mean"), "entropy_aggregation must be one of"),
    (dict(kl_estimator="k3_rat"), "kl_estimator must be one of"),
    (dict(negative_adv_ratio_cap=1.1, epsilon_high=0.28), r"negative_adv_ratio_cap .*> 1 \+"),
    (dict(negative_adv_ratio_cap=3.0, surrogate="cispo"), "negative_adv_ratio_cap .*ppo_clip"),
    (dict(cispo_ratio_cap=0.0), "cispo_ratio_cap must be finite and > 0"),
    (dict(sapo_temperature_neg=-1.0), "sapo_temperature_neg must be"),
    (dict(vespo_k_pos=-1.0), "vespo_k_pos must be finite and >= 0"),
    (dict(surrogate="vespo", importance_level="sequence"), "importance_level must be 'token'"),
    (dict(off_policy_kl_threshold=-0.1), "off_policy_kl_threshold must be"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be in"),
    (dict(entropy_target=-1.0), "entropy_target must be finite and >= 0"),
    (dict(entropy_coef_delta=0.0), "entropy_coef_delta must be finite and > 0"),
    (dict(entropy_target=0.5, entropy_coef_min=0.5, entropy_coef_max=0.1),
     "entropy_coef_min=0.5 must be <= entropy_coef_max=0.1"),
    (dict(entropy_target=0.5, top_entropy_quantile=0.2), "top_entropy_quantile must be 1"),
])
def test_bad_variant_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**kwargs)


VARIANTS = [dict(surrogate="cispo", cispo_ratio_cap=1.2), dict(surrogate="sapo"),
            dict(surrogate="vespo", tis_cap=2.0), dict(negative_adv_ratio_cap=1.4),
            dict(off_policy_kl_threshold=0.0), dict(top_entropy_quantile=0.5),
            dict(beta=0.1, kl_estimator="k3_ratio"),
            dict(entropy_coef=0.1, entropy_aggregation="tokens"),
            dict(importance_level="sequence", aggregation="seq_mean_token_sum")]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_variants_jit_equals_eager_and_padding_has_zero_gradient(variant):
    # Garbage at a padding position (ratio e^1000) gives finite values and exactly 0 there.
    cfg = PolicyLossConfig(**variant)
    mask = MASK.at[1, 2].set(0)
    logp = LOGP.at[1, 2].set(1000.0)
    kw = dict(ref_logp_BxT=OLD - 0.1, sampler_logp_BxT=OLD + 0.2, max_completion_len=3)

    def loss(lp, entropy):
        return policy_loss(lp, OLD, ADV, mask, cfg, entropy_BxT=entropy, **kw)

    entropy = jnp.array([[0.5, 2.0, 1.0], [1.5, 0.2, 9.0]])
    eager, grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(logp, entropy)
    jitted = jax.jit(loss)(logp, entropy)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 jitted, eager)
    assert np.isfinite(eager[0]) and all(np.isfinite(g).all() for g in grads)
    assert float(grads[0][1, 2]) == 0.0 and float(grads[1][1, 2]) == 0.0


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "top_entropy_quantile" not in v],
                         ids=lambda v: "-".join(map(str, v.values())))
def test_variants_microbatches_sum_to_the_batch(variant):
    # With the batch's counts, the two rows' losses and gradients sum to the batch's (the
    # top-entropy quantile is taken over each call's own tokens: not accumulable).
    cfg = PolicyLossConfig(**variant)
    mask = MASK.at[1, 2].set(0)
    entropy = jnp.array([[0.5, 2.0, 1.0], [1.5, 0.2, 9.0]])
    kw = dict(ref_logp_BxT=OLD - 0.1, sampler_logp_BxT=OLD + 0.2, entropy_BxT=entropy,
              max_completion_len=3, num_tokens=jnp.sum(mask), num_seqs=2)

    def loss(lp, rows):
        return policy_loss(lp, OLD[rows], ADV[rows], mask[rows], cfg,
                           **{k: v[rows] if k.endswith("BxT") else v for k, v in kw.items()})[0]

    whole, whole_grad = jax.value_and_grad(loss)(LOGP, slice(None))
    parts = [jax.value_and_grad(loss)(LOGP[i:i + 1], slice(i, i + 1)) for i in range(2)]
    np.testing.assert_allclose(sum(p[0] for p in parts), whole, rtol=1e-5)
    np.testing.assert_allclose(jnp.concatenate([p[1] for p in parts]), whole_grad, atol=1e-6)


def test_cispo_keeps_a_gradient_where_ppo_clips():
    # Ratio 1.5 with A = +1 is clipped by PPO (no gradient); CISPO weighs its log-prob by
    # sg(min(1.5, 1.2)) = 1.2: d/dlogp = -1.2 / 6 (token mean over 6 tokens).
    cfg = PolicyLossConfig(surrogate="cispo", cispo_ratio_cap=1.2)
    grad = jax.grad(lambda lp: policy_loss(lp, OLD, ADV, MASK, cfg)[0])(LOGP)
    np.testing.assert_allclose(grad[0, 0], -1.2 / 6, rtol=1e-5)
    np.testing.assert_allclose(grad[0, 1], -0.5 / 6, rtol=1e-5)  # below the cap: the ratio
