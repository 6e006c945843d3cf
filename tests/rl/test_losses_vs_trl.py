"""`policy_loss` against TRL 1.16's own `GRPOTrainer._compute_loss` as the oracle.

TRL's method runs unchanged on a stand-in `self` that has exactly the attributes it reads; its
model forward is replaced by the synthetic per-token log-probs and entropies (float64 leaf
tensors), so the loss and its gradient with respect to them can be compared with jaxrl's on
the same inputs, in float64. Every case also checks that its setting changes the loss or the
gradient, so a setting that jaxrl ignored could not pass.
"""

import collections
import dataclasses
import math
import types

import jax
import numpy as np
import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from jaxrl.rl import PolicyLossConfig, policy_loss
from jaxrl.rl.loss_variants import adapt_entropy_coef, applied_entropy_coef

B, T = 4, 6
LENGTHS = np.array([6, 3, 5, 1])  # unequal lengths; padding holds ordinary values
MASK = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.float64)
_rng = np.random.default_rng(0)
OLD = -_rng.uniform(0.2, 3.0, (B, T))
LOGP = OLD + _rng.normal(0.0, 0.5, (B, T))  # ratios from ~0.4 to ~2.5: both clips bind
REF = OLD + _rng.normal(0.0, 0.3, (B, T))
SAMPLER = OLD + _rng.normal(0.0, 0.3, (B, T))
ENTROPY = _rng.uniform(0.1, 3.0, (B, T))
ADV = np.array([1.2, -0.7, -1.5, 0.4])


class _Accelerator:
    """One process, no accumulation: every collective is the identity."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction):
        return x

    def pad_across_processes(self, x, dim, pad_index):
        return x


class _TRL:
    """The attributes `GRPOTrainer._compute_loss` reads, at TRL's defaults (DAPO, eps 0.2)."""

    _compute_loss = GRPOTrainer._compute_loss
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask
    get_off_policy_mask = GRPOTrainer.__dict__["get_off_policy_mask"]
    get_gamma_weights = GRPOTrainer.__dict__["get_gamma_weights"]

    def __init__(self, logp, entropy, settings):
        self.logp, self.entropy = logp, entropy
        self.args = types.SimpleNamespace(
            use_bias_correction_kl=False, delta=None, sapo_temperature_pos=1.0,
            sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
            vespo_lambda_neg=2.0, steps_per_generation=1, entropy_target=0.2,
            entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0)
        self.loss_type, self.epsilon_low, self.epsilon_high, self.beta = "dapo", 0.2, 0.2, 0.0
        self.importance_sampling_level = "token"
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
        self.use_vllm = self.vllm_importance_sampling_correction = False
        self.entropy_coef, self.use_adaptive_entropy = 0.0, False
        for name, value in settings.items():
            setattr(self.args if hasattr(self.args, name) else self, name, value)
        self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy
        self._last_world_entropy, self._entropy_window_stats = math.inf, None
        self.max_completion_length, self.current_gradient_accumulation_steps = T, 1
        self.aux_loss_enabled = False
        self.model = types.SimpleNamespace(training=True)
        self.accelerator = _Accelerator()
        self._metrics = collections.defaultdict(lambda: collections.defaultdict(list))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, **_):
        return self.logp, self.entropy, None


def trl_inputs(mask, rows=slice(None)):
    """TRL's `inputs` for the rows `rows` of a batch with loss mask `mask`; num_items_in_batch
    counts the valid tokens of the whole batch (TRL: of the generation batch)."""
    t = torch.tensor
    n = len(ADV[rows])
    return {"prompt_ids": torch.zeros((n, 1), dtype=torch.long),
            "prompt_mask": torch.ones((n, 1)),
            "completion_ids": torch.zeros((n, T), dtype=torch.long),
            "completion_mask": t(mask[rows]), "advantages": t(ADV[rows]),
            "old_per_token_logps": t(OLD[rows]), "ref_per_token_logps": t(REF[rows]),
            "num_items_in_batch": t(mask.sum())}


def trl_loss(settings, sampler=False, tis_cap=None):
    """TRL's (loss, d loss / d logp, d loss / d entropy, metrics)."""
    logp = torch.tensor(LOGP, requires_grad=True)
    entropy = torch.tensor(ENTROPY, requires_grad=True)
    t = torch.tensor
    inputs = trl_inputs(MASK)
    if sampler:
        inputs["sampling_per_token_logps"] = t(SAMPLER)
    if tis_cap is not None:
        # As TRL's _generate_and_score_completions ("token_truncate"): 1 at padding.
        inputs["importance_sampling_ratio"] = torch.clamp(t(np.exp((OLD - SAMPLER) * MASK)),
                                                          max=tis_cap)
        settings = settings | {"use_vllm": True, "vllm_importance_sampling_correction": True}
    trainer = _TRL(logp, entropy, settings)
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    grad_h = np.zeros_like(ENTROPY) if entropy.grad is None else entropy.grad.numpy()
    return loss.item(), logp.grad.numpy(), grad_h, trainer._metrics["train"]


def jaxrl_loss(settings, sampler=False):
    """jaxrl's (loss, d loss / d logp, d loss / d entropy, metrics)."""
    cfg = PolicyLossConfig(**settings)

    def loss(logp, entropy):
        return policy_loss(logp, OLD, ADV, MASK, cfg, ref_logp_BxT=REF,
                           sampler_logp_BxT=SAMPLER if sampler else None, entropy_BxT=entropy,
                           max_completion_len=T)

    (value, metrics), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        LOGP, ENTROPY)
    return float(value), np.asarray(grads[0]), np.asarray(grads[1]), metrics


@pytest.fixture(autouse=True)
def x64():
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


# (id, jaxrl settings, TRL settings, the jaxrl setting under test, TRL's, sampler log-probs).
# The loss with the base settings alone must differ: the setting under test is what matches.
CASES = [
    ("dapo_clip_higher", {}, {}, {"epsilon_high": 0.28}, {"epsilon_high": 0.28}, False),
    ("bnpo", {}, {"loss_type": "bnpo"}, {"epsilon_low": 0.3}, {"epsilon_low": 0.3}, False),
    ("grpo", {}, {"loss_type": "grpo"}, {"aggregation": "seq_mean_token_mean"}, {}, False),
    ("dr_grpo", {}, {"loss_type": "dr_grpo"},
     {"aggregation": "seq_mean_token_sum_norm"}, {}, False),
    ("gspo", {"aggregation": "seq_mean_token_mean", "epsilon_low": 0.1, "epsilon_high": 0.1},
     {"loss_type": "grpo", "epsilon_low": 0.1, "epsilon_high": 0.1},
     {"importance_level": "sequence"}, {"importance_sampling_level": "sequence"}, False),
    ("luspo", {"importance_level": "sequence"},
     {"loss_type": "luspo", "importance_sampling_level": "sequence"},
     {"aggregation": "seq_mean_token_sum"}, {}, False),
    ("kl_k3", {}, {}, {"beta": 0.04}, {"beta": 0.04}, False),
    ("kl_k3_ratio", {"beta": 0.04}, {"beta": 0.04},
     {"kl_estimator": "k3_ratio"}, {"use_bias_correction_kl": True}, False),
    ("kl_k3_ratio_sequence", {"beta": 0.04, "importance_level": "sequence"},
     {"beta": 0.04, "importance_sampling_level": "sequence"},
     {"kl_estimator": "k3_ratio"}, {"use_bias_correction_kl": True}, False),
    ("entropy_bonus_tokens", {"aggregation": "seq_mean_token_mean", "entropy_coef": 0.1},
     {"loss_type": "grpo", "entropy_coef": 0.1}, {"entropy_aggregation": "tokens"}, {}, False),
    ("cispo", {"cispo_ratio_cap": 1.3}, {"loss_type": "cispo", "epsilon_high": 1.3},
     {"surrogate": "cispo"}, {}, False),
    ("sapo", {"aggregation": "seq_mean_token_mean"}, {"loss_type": "grpo"},
     {"surrogate": "sapo"}, {"loss_type": "sapo"}, False),
    ("vespo", {}, {}, {"surrogate": "vespo"}, {"loss_type": "vespo"}, False),
    ("cispo_sequence", {"surrogate": "cispo", "cispo_ratio_cap": 1.05},
     {"loss_type": "cispo", "epsilon_high": 1.05},
     {"importance_level": "sequence"}, {"importance_sampling_level": "sequence"}, False),
    ("sapo_sequence", {"surrogate": "sapo", "aggregation": "seq_mean_token_mean"},
     {"loss_type": "sapo"},
     {"importance_level": "sequence"}, {"importance_sampling_level": "sequence"}, False),
    ("luspo_token", {}, {"loss_type": "luspo"}, {"aggregation": "seq_mean_token_sum"}, {},
     False),
    ("negative_adv_ratio_cap", {"epsilon_high": 0.28}, {"epsilon_high": 0.28},
     {"negative_adv_ratio_cap": 1.5}, {"delta": 1.5}, False),
    # The negative sequences' mean KLs are 0.23 and -0.02 (old), 0.45 and 0.005 (sampler):
    # just under the first, so it alone is dropped.
    ("off_policy_mask", {}, {}, {"off_policy_kl_threshold": 0.2},
     {"off_policy_mask_threshold": 0.2}, False),
    ("off_policy_mask_sampler", {}, {}, {"off_policy_kl_threshold": 0.4},
     {"off_policy_mask_threshold": 0.4}, True),
    ("top_entropy", {}, {}, {"top_entropy_quantile": 0.2}, {"top_entropy_quantile": 0.2}, False),
    ("top_entropy_with_bonus", {"entropy_coef": 0.1, "entropy_aggregation": "tokens"},
     {"entropy_coef": 0.1}, {"top_entropy_quantile": 0.2}, {"top_entropy_quantile": 0.2}, False),
]


@pytest.mark.parametrize("base, trl_base, setting, trl_setting, sampler",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_policy_loss_matches_trl(base, trl_base, setting, trl_setting, sampler):
    want, want_grad, want_grad_h, _ = trl_loss(trl_base | trl_setting, sampler)
    got, grad, grad_h, _ = jaxrl_loss(base | setting, sampler)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6)
    np.testing.assert_allclose(grad_h, want_grad_h, rtol=0, atol=1e-6)
    without, without_grad, without_grad_h, _ = jaxrl_loss(base, sampler)
    assert (abs(without - got) > 1e-4 or np.abs(without_grad - grad).max() > 1e-4
            or np.abs(without_grad_h - grad_h).max() > 1e-4)


def test_truncated_importance_weights_match_trls_vllm_correction():
    # TRL's importance_sampling_ratio (vllm_importance_sampling_mode="token_truncate") is
    # min(pi_old / pi_sampler, cap); jaxrl's tis weight is the same, and both multiply it
    # into the policy term only.
    want, want_grad, _, _ = trl_loss({"beta": 0.04}, sampler=True, tis_cap=1.2)
    got, grad, _, _ = jaxrl_loss({"beta": 0.04, "tis_cap": 1.2}, sampler=True)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6)
    assert abs(jaxrl_loss({"beta": 0.04}, sampler=True)[0] - got) > 1e-4


def test_vespo_folds_the_truncated_importance_weights_into_its_sequence_weight():
    want, want_grad, _, _ = trl_loss({"loss_type": "vespo"}, sampler=True, tis_cap=1.2)
    got, grad, _, _ = jaxrl_loss({"surrogate": "vespo", "tis_cap": 1.2}, sampler=True)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6)
    assert abs(jaxrl_loss({"surrogate": "vespo"}, sampler=True)[0] - got) > 1e-4


@pytest.mark.parametrize("settings, trl_settings, name, trl_name", [
    ({"epsilon_high": 0.28}, {"epsilon_high": 0.28}, "clip_frac", "clip_ratio/region_mean"),
    ({"surrogate": "cispo", "cispo_ratio_cap": 1.3}, {"loss_type": "cispo", "epsilon_high": 1.3},
     "clip_frac", "cispo_clip_ratio"),
    ({"entropy_coef": 0.1}, {"entropy_coef": 0.1}, "entropy", "entropy"),
])
def test_metrics_match_trl(settings, trl_settings, name, trl_name):
    trl_metrics = trl_loss(trl_settings)[3]
    metrics = jaxrl_loss(settings)[3]
    np.testing.assert_allclose(metrics[name], trl_metrics[trl_name][0], rtol=1e-6)
    assert 0 < float(metrics[name])


def test_adaptive_entropy_coefficient_follows_trls_controller():
    # One optimizer update per call, entropies around the target 1.0 (the mean of ENTROPY is
    # ~1.6): TRL's coefficient after each update and each update's loss (which applies the
    # coefficient only while the last entropy was at or below the target) against jaxrl's.
    settings = {"entropy_coef": 0.05, "entropy_target": 1.0, "entropy_coef_delta": 0.02,
                "entropy_coef_min": 0.01, "entropy_coef_max": 0.08}
    cfg = PolicyLossConfig(**settings)
    trainer = _TRL(None, None, settings | {"use_adaptive_entropy": True})
    coef, last = np.float64(0.05), np.float64(np.inf)
    coefs, trl_coefs = [], []
    for scale in (0.5, 0.4, 0.3, 2.0, 0.5, 3.0, 3.0, 3.0, 3.0, 3.0, 0.2):
        trainer.logp = torch.tensor(LOGP, requires_grad=True)
        trainer.entropy = torch.tensor(ENTROPY * scale, requires_grad=True)
        inputs = {"prompt_ids": torch.zeros((B, 1), dtype=torch.long),
                  "prompt_mask": torch.ones((B, 1)),
                  "completion_ids": torch.zeros((B, T), dtype=torch.long),
                  "completion_mask": torch.tensor(MASK), "advantages": torch.tensor(ADV),
                  "old_per_token_logps": torch.tensor(OLD),
                  "num_items_in_batch": torch.tensor(MASK.sum())}
        want = trainer._compute_loss(None, inputs).item()
        trl_coefs.append(trainer.entropy_coef)
        got, metrics = policy_loss(LOGP, OLD, ADV, MASK, cfg, entropy_BxT=ENTROPY * scale,
                                   entropy_coef=applied_entropy_coef(coef, last, cfg))
        np.testing.assert_allclose(got, want, rtol=1e-5)
        coef, last = adapt_entropy_coef(coef, metrics["entropy"], cfg), metrics["entropy"]
        coefs.append(float(coef))
    np.testing.assert_allclose(coefs, trl_coefs, rtol=1e-9)
    # It moved both ways and hit both bounds.
    assert max(coefs) == 0.08 and min(coefs) == 0.01


# Two microbatches of rows (0, 1) and (2, 3) with 8 valid tokens each.
ACCUM_MASK = (np.arange(T)[None, :] < np.array([6, 2, 3, 5])[:, None]).astype(np.float64)


@pytest.mark.parametrize("quantile", [0.3, 1.0])
@pytest.mark.parametrize("num_micro", [1, 2])
def test_tokens_entropy_bonus_under_accumulation_matches_trl(num_micro, quantile):
    """The `tokens` bonus summed over microbatches, against TRL's accumulation of them.

    TRL (GRPOTrainer.loss_is_scaled_for_ga: the Trainer neither rescales the loss nor averages
    it: each microbatch's backward adds its gradient) divides the DAPO policy term by
    num_items_in_batch · current_gradient_accumulation_steps / steps_per_generation, the
    minibatch's valid tokens here (both are M), and the bonus, the mean of H over the
    microbatch's kept tokens, by M: the minibatch's bonus is (1/M) sum_m kept mean_m. jaxrl's
    calls, given the minibatch's num_tokens N, sum to sum_m (V_m / N) · kept mean_m, the same
    exactly when every microbatch holds N / M valid tokens, as these two (8 each; the top-30%
    quantile is per microbatch in both, so the kept counts, 3 each, need not match). q = 0.3
    puts no threshold on a data point: TRL takes the quantile in float32, which there can
    drop the token that float64 keeps.
    """
    rows = np.split(np.arange(B), num_micro)
    settings = {"entropy_coef": 0.1, "top_entropy_quantile": quantile}
    logp = torch.tensor(LOGP, requires_grad=True)
    entropy = torch.tensor(ENTROPY, requires_grad=True)
    want = 0.0
    for r in rows:
        trainer = _TRL(logp[r], entropy[r], settings | {"steps_per_generation": num_micro})
        trainer.current_gradient_accumulation_steps = num_micro
        loss = trainer._compute_loss(None, trl_inputs(ACCUM_MASK, r))
        loss.backward()  # the gradients of the microbatches add up in logp.grad, entropy.grad
        want += loss.item()

    def jaxrl(lp, h, cfg):
        return sum(policy_loss(lp[r], OLD[r], ADV[r], ACCUM_MASK[r], cfg, entropy_BxT=h[r],
                               num_tokens=ACCUM_MASK.sum(), num_seqs=B)[0] for r in rows)

    cfg = PolicyLossConfig(entropy_coef=0.1, entropy_aggregation="tokens",
                           top_entropy_quantile=quantile)
    got, (grad, grad_h) = jax.value_and_grad(jaxrl, argnums=(0, 1))(LOGP, ENTROPY, cfg)
    print(f"M={num_micro} q={quantile}: TRL {want:.9f}, jaxrl {float(got):.9f}")
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(grad, logp.grad.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(grad_h, entropy.grad.numpy(), rtol=0, atol=1e-6)
    without = jaxrl(LOGP, ENTROPY, dataclasses.replace(cfg, entropy_coef=0.0))
    assert abs(without - got) > 1e-2  # the bonus is what matches
