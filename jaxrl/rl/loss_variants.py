"""The per-token policy terms and token masks of `policy_loss` beyond PPO's clip, each as TRL
1.16 computes it (`trl.trainer.grpo_trainer.GRPOTrainer._compute_loss`; checked against it in
tests/rl/test_losses_vs_trl.py).

With r_it the importance ratio (token, or GSPO's sequence ratio), A the advantage and sg the
stop-gradient, the policy term pg_it of `PolicyLossConfig.surrogate`:

    ppo_clip  -min(min(r, c) · A, clip(r, 1 - eps_low, 1 + eps_high) · A)      PPO / GRPO / DAPO
              c = negative_adv_ratio_cap (None: inf). With c > 1 + eps_high the cap binds only
              when A < 0: a negative-advantage token far off-policy (r ≫ 1) pushes with at most
              c·A instead of an unbounded r·A. Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729)
              and INTELLECT-2's two-sided clipping (arXiv:2505.07291); TRL `delta`, verl
              `clip_ratio_c`.
    cispo     -sg(min(r, cispo_ratio_cap)) · A · logp_it                       CISPO (MiniMax-M1,
              arXiv:2506.13585; ScaleRL's eps_max, arXiv:2510.13786): the weight is clipped, never
              the gradient, so every token keeps a gradient. TRL loss_type="cispo" with
              epsilon_high = the cap (recommended 5.0).
    sapo      -(4 / tau) · sigmoid(tau · (r - 1)) · A,  tau = tau_pos if A > 0 else tau_neg
              SAPO (Qwen, arXiv:2511.20347): a smooth gate instead of the hard clip; its gradient
              weight 4·s·(1 - s) is 1 at r = 1 and decays off-policy. TRL loss_type="sapo",
              sapo_temperature_pos/neg.
    vespo     -sg(phi(w_i)) · A · logp_it,  phi(w) = exp(lambda) · w^k · exp(-lambda · w)
              VESPO (arXiv:2602.10693): w_i = exp(sum_t log r_it (+ log of the behaviour weight))
              the sequence's (product, not geometric-mean) ratio, each log clamped to
              [log 1e-8, 20] as in TRL; (k, lambda) = (k_pos, lambda_pos) if A >= 0 else
              (k_neg, lambda_neg); phi(1) = 1. TRL loss_type="vespo", vespo_k/lambda_pos/neg.

Token masks on the policy term (the KL term keeps every valid token, as in TRL):

    off-policy sequence mask   keep sequence i iff A_i >= 0 or
                               mean_t (logp_behaviour_it - sg(logp_it)) <= off_policy_kl_threshold
        DeepSeek-V3.2 (arXiv:2512.02556, eq. 9): negative samples the current policy has moved
        far from are dropped. The behaviour log-probs are the sampler's when the loss reads
        them, else old_logp (TRL: sampling_per_token_logps, else old_per_token_logps). TRL
        off_policy_mask_threshold.
    top-entropy token mask     keep token it iff H_it >= quantile_{1 - q}(H over valid tokens)
        "Beyond the 80/20 rule" (arXiv:2506.01939, q = 0.2): the gradient only on the forking
        tokens; the entropy bonus acts on the same tokens (as TRL). Linear interpolation, as torch.quantile. TRL top_entropy_quantile. Deviation:
        the quantile is over this call's tokens, so under gradient accumulation over the
        microbatch's (TRL: over the micro-batch of every process, gathered).

The adaptive entropy coefficient (Skywork-OR1, arXiv:2505.22312; TRL use_adaptive_entropy,
entropy_target, entropy_coef_delta/min/max): after each optimizer update with token-mean
entropy H (over the update's whole minibatch), c <- min(c + delta, c_max) if H <= target else
max(c - delta, c_min), starting from entropy_coef; an update applies c only while the previous
update's H was <= target (so not the first). The state lives with the optimizer
(`jaxrl.step.state.TrainState`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl.rl.loss_config import PolicyLossConfig

_LOG_MIN_W = math.log(1e-8)  # VESPO's clamp of log-weights, as TRL (the paper's 1e-8 floor)


def surrogate_term(cfg: PolicyLossConfig, logp_BxT: jax.Array, log_ratio_BxT: jax.Array, ratio_BxT: jax.Array,
                   adv_Bx1: jax.Array, valid_BxT: jax.Array,
                   log_behaviour_w_BxT: jax.Array | None = None,
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(pg_BxT, per-token metric values) of cfg.surrogate, see the
    module doc; log_ratio_BxT is the token-level log-ratio (VESPO sums it), ratio_BxT the
    importance ratio (token or sequence level); log_behaviour_w_BxT: VESPO folds the behaviour
    weight into its sequence weight (instead of multiplying the term, as TRL does)."""
    if cfg.surrogate == "ppo_clip":
        clipped_BxT = jnp.clip(ratio_BxT, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * adv_Bx1
        capped_BxT = ratio_BxT
        metrics = {"clip_frac": clipped_BxT < ratio_BxT * adv_Bx1}
        if cfg.negative_adv_ratio_cap is not None:
            capped_BxT = jnp.minimum(ratio_BxT, cfg.negative_adv_ratio_cap)
            metrics["clip_frac/negative_cap"] = ((ratio_BxT > cfg.negative_adv_ratio_cap)
                                                 & (adv_Bx1 < 0))
        return -jnp.minimum(capped_BxT * adv_Bx1, clipped_BxT), metrics
    if cfg.surrogate == "cispo":
        weight_BxT = jax.lax.stop_gradient(jnp.minimum(ratio_BxT, cfg.cispo_ratio_cap))
        clipped = (ratio_BxT > cfg.cispo_ratio_cap) & (adv_Bx1 > 0)
        return -weight_BxT * adv_Bx1 * logp_BxT, {"clip_frac": clipped}
    if cfg.surrogate == "sapo":
        tau = jnp.where(adv_Bx1 > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        gate_BxT = jax.nn.sigmoid(tau * (ratio_BxT - 1))
        return -gate_BxT * 4 / tau * adv_Bx1, {
            "sapo/gate_weight": jax.lax.stop_gradient(4 * gate_BxT * (1 - gate_BxT))}
    if cfg.surrogate == "vespo":
        phi = vespo_weight(cfg, log_ratio_BxT, adv_Bx1, valid_BxT, log_behaviour_w_BxT)
        return -phi * adv_Bx1 * logp_BxT, {"vespo/weight": jnp.broadcast_to(phi, logp_BxT.shape)}
    raise ValueError(f"unknown surrogate {cfg.surrogate!r}")


def vespo_weight(cfg: PolicyLossConfig, log_ratio_BxT: jax.Array, adv_Bx1: jax.Array, valid_BxT: jax.Array,
                 log_behaviour_w_BxT: jax.Array | None) -> jax.Array:
    """VESPO's gamma weight sg(phi(w_i)) of each sequence ([B, 1], or [B, T] with per-token
    advantages), from the masked token log-ratios (module doc)."""
    log_ratio_BxT = jax.lax.stop_gradient(log_ratio_BxT)
    log_w_Bx1 = jnp.sum(jnp.where(valid_BxT, jnp.clip(log_ratio_BxT, -20.0, 20.0), 0.0),
                        axis=1, keepdims=True)
    if log_behaviour_w_BxT is not None:
        log_w_Bx1 += jnp.sum(jnp.where(valid_BxT, jnp.clip(
            jax.lax.stop_gradient(log_behaviour_w_BxT), _LOG_MIN_W, 20.0), 0.0),
            axis=1, keepdims=True)
    log_w_Bx1 = jnp.clip(log_w_Bx1, _LOG_MIN_W, 20.0)
    nonneg = adv_Bx1 >= 0
    k = jnp.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = jnp.maximum(jnp.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w_Bx1 - lam * jnp.exp(log_w_Bx1))
    return jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_sequence_mask(adv_Bx1: jax.Array, logp_BxT: jax.Array,
                             behaviour_logp_BxT: jax.Array, valid_BxT: jax.Array,
                             count_B: jax.Array, threshold: float) -> jax.Array:
    """DeepSeek-V3.2's keep mask (module doc): [B, 1] (or [B, T] with per-token advantages),
    True where the sequence stays in the policy term."""
    kl_BxT = jnp.where(valid_BxT, behaviour_logp_BxT - jax.lax.stop_gradient(logp_BxT), 0.0)
    mean_kl_Bx1 = jnp.sum(kl_BxT, axis=1, keepdims=True) / jnp.maximum(count_B, 1.0)[:, None]
    return (adv_Bx1 >= 0) | (mean_kl_Bx1 <= threshold)


def top_entropy_mask(entropy_BxT: jax.Array, valid_BxT: jax.Array,
                     quantile: float) -> jax.Array:
    """The valid tokens whose entropy is at least the (1 - quantile) quantile of the valid
    tokens' entropies ("80/20", module doc); none when no token is valid."""
    entropy_BxT = jax.lax.stop_gradient(entropy_BxT)
    threshold = jnp.nanquantile(jnp.where(valid_BxT, entropy_BxT, jnp.nan), 1 - quantile)
    return valid_BxT & (entropy_BxT >= threshold)


def adapt_entropy_coef(coef: jax.Array, entropy: jax.Array, cfg: PolicyLossConfig) -> jax.Array:
    """The adaptive coefficient after an update whose token-mean entropy was `entropy`."""
    return jnp.where(entropy <= cfg.entropy_target,
                     jnp.minimum(coef + cfg.entropy_coef_delta, cfg.entropy_coef_max),
                     jnp.maximum(coef - cfg.entropy_coef_delta, cfg.entropy_coef_min))


def applied_entropy_coef(coef: jax.Array, last_entropy: jax.Array,
                         cfg: PolicyLossConfig) -> jax.Array:
    """The coefficient an update applies: the adaptive one while the last entropy was at or
    below the target, else 0."""
    return jnp.where(last_entropy <= cfg.entropy_target, coef, 0.0)
