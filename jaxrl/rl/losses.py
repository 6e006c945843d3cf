"""The clipped policy-gradient loss of the GRPO family (GRPO, DAPO, Dr. GRPO, GSPO, LUSPO;
CISPO, SAPO, VESPO in `jaxrl.rl.loss_variants`), with KL, entropy bonus and truncated
importance sampling.

Per completion token t of sequence i (mask m_it = 1), with advantage A_i (or a per-token
A_it, PPO's GAE with a critic: `jaxrl.rl.gae`; adv_B then has shape [B, T]):

    ratio_it = exp(logp_it - old_logp_it)                         "token" (PPO, GRPO, DAPO)
             = exp(sum_t m_it (logp_it - old_logp_it) / |y_i|)    "sequence" (GSPO), the same
                                                                  for every token of sequence i
    pg_it    = -min(ratio_it · A_i, clip(ratio_it, 1 - eps_low, 1 + eps_high) · A_i)
    w_it     = the behaviour weight, from rho_it = exp(old_logp_it - sampler_logp_it):
               "tis"        min(rho_it, tis_cap)                   truncated IS (1 when no cap)
               "mis"        rho_it · [rho_it <= tis_cap]           masked IS: a token whose
                                                                   weight passes the cap drops
               "decoupled"  rho_it                                 decoupled PPO (AReaL): the
                                                                   clip is against the proximal
                                                                   policy old_logp, the weight
                                                                   corrects for the behaviour
               "none"       1, and the ratio's old_logp is the sampler's own (plain PPO against
                            the policy that generated: its clip absorbs the staleness)
    kl_it    = k(log r_it),  log r_it = ref_logp_it - logp_it     Schulman's estimators of
               k1 = -log r,  k2 = (log r)^2 / 2,  k3 = r - 1 - log r      KL(pi || ref)
               k3_ratio = ratio_it · k3 (DeepSeek-V3.2: unbiased from pi_old's samples)
    l_it     = w_it · pg_it + beta · kl_it - entropy_coef · H_it

and the loss aggregates l over the valid tokens:

    token_mean               sum_it m l / sum_it m                     (DAPO: every token counts
                                                                        the same)
    seq_mean_token_mean      mean_i [sum_t m l / |y_i|]                (GRPO paper; with
                                                                        "sequence" = GSPO paper)
    seq_mean_token_sum_norm  mean_i [sum_t m l / max_completion_len]   (Dr. GRPO: no length bias)
    seq_mean_token_sum       mean_i [sum_t m l]                        (LUSPO, arXiv:2602.05261,
                                                                        with "sequence": GSPO's
                                                                        loss times |y_i|)

pg above is surrogate="ppo_clip"; `jaxrl.rl.loss_variants` holds the other surrogates (CISPO,
SAPO, VESPO), the cap of negative-advantage ratios, DeepSeek-V3.2's off-policy sequence mask
and the top-entropy token mask, with their equations, papers and TRL names.

eps_high > eps_low is DAPO's clip-higher; GSPO's sequence ratios need far narrower clip
ranges (the paper uses 3e-4 / 4e-4). For one on-policy gradient step per batch pass
`old_logp = stop_gradient(logp)`: the ratio is 1 and the loss gradient is the policy gradient.

Deliberate choices:
- "mean over sequences" counts only sequences with at least one valid token. A fully masked
  row (a zero-std group, see advantages.py) then vanishes from every aggregation, instead of
  diluting the gradient as groups saturate (TRL divides by the batch size B).
- KL is added per token and aggregated like the policy term (as TRL and verl do), so
  `loss = loss/policy + beta · loss/kl - entropy_coef · agg_H(H)` with `loss/kl` the
  aggregated estimator (unscaled by beta). agg_H is entropy_aggregation: "policy" (the
  default) aggregates H like the policy term (verl); "tokens" is the mean of H over the valid
  tokens whatever the aggregation (TRL's entropy_coef: its bonus is not rescaled to the loss
  type's normalisation). Under gradient accumulation "tokens" is the mean over the whole
  minibatch (num_tokens valid tokens), so accumulation-invariant; TRL averages its
  microbatches' means (the same when they hold equally many valid tokens). With
  top_entropy_quantile < 1 the bonus acts on the kept tokens K_m of each call m (the
  quantile is per call, as TRL's), and a call's share of the minibatch's bonus is its kept
  mean weighted by its valid tokens V_m:

      agg_H = sum_m (V_m / num_tokens) · (sum_{it in K_m} H_it / |K_m|)

  One call: the kept mean (TRL's); M calls with equal V_m: (1/M) sum_m kept mean_m (TRL's
  accumulation); q = 1 (|K_m| = V_m): sum_it m H / num_tokens, the token mean again.
- Masked tokens are zeroed with `where` in every input, not multiplied by 0 at the end, so
  garbage log-probs at padding (an overflowing ratio) give neither a NaN loss nor a NaN
  gradient, and their gradient is exactly 0.

The sampler's log-probs are the behaviour policy (under asynchronous RL, weights up to k
updates older than old_logp's); old_logp is the trainer's own forward at the weights before
this batch's first update (the proximal policy).

Metrics, float32 scalars: `loss/policy` (aggregated w · pg), `loss/kl` (0 when beta = 0),
`clip_frac` (fraction of valid tokens whose clipped branch is strictly smaller, so has no
gradient), `entropy` (token mean of H, when given) and `tis/weight_mean` (token mean of w,
when tis_cap is set). With the sampler's log-probs: `async/ratio_mean` (token mean of rho),
`async/ratio_clipped_frac` (tokens whose rho passes tis_cap: truncated or masked) and
`async/kl_behaviour` (k3 estimate of KL(behaviour || proximal) from the behaviour's samples,
log r = old_logp - sampler_logp). The variants add theirs (token means): `clip_frac/negative_cap`
(A < 0 and ratio past negative_adv_ratio_cap), `sapo/gate_weight` (SAPO's gradient weight),
`vespo/weight` (phi), `off_policy/masked_frac` and `entropy_mask/kept_frac`; with CISPO
`clip_frac` counts the tokens with A > 0 whose weight was capped (as TRL).
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp

from jaxrl.rl import loss_variants
from jaxrl.rl.loss_config import Aggregation, KLEstimator, PolicyLossConfig


def _float(x: jax.Array) -> jax.Array:
    """x in float32 at least (bfloat16 is widened, float64 kept)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def kl_estimate(logp_BxT: jax.Array, ref_logp_BxT: jax.Array, estimator: KLEstimator,
                ratio_BxT: jax.Array | None = None) -> jax.Array:
    """Per-token estimate of KL(pi || ref) from samples of pi, with log r = ref_logp - logp.

    k1 = -log r (unbiased, can be negative), k2 = (log r)^2 / 2 (biased, >= 0),
    k3 = r - 1 - log r (unbiased, >= 0 since e^x >= 1 + x);
    k3_ratio = (pi / pi_old) · k3, with ratio_BxT the loss's importance ratio (differentiated
    through): from samples of pi_old, its gradient is the unbiased gradient of KL(pi || ref)
    (DeepSeek-V3.2, arXiv:2512.02556; TRL use_bias_correction_kl).
    """
    log_r_BxT = _float(ref_logp_BxT) - _float(logp_BxT)
    if estimator == "k1":
        return -log_r_BxT
    if estimator == "k2":
        return 0.5 * jnp.square(log_r_BxT)
    if estimator in ("k3", "k3_ratio"):
        k3_BxT = jnp.expm1(log_r_BxT) - log_r_BxT
        if estimator == "k3":
            return k3_BxT
        if ratio_BxT is None:
            raise ValueError("kl_estimator='k3_ratio' weighs k3 by the importance ratio: "
                             "pass ratio_BxT")
        return k3_BxT * ratio_BxT
    raise ValueError(f"kl_estimator must be one of {typing.get_args(KLEstimator)}, "
                     f"got {estimator!r}")


def token_counts(mask_BxT: jax.Array, num_tokens: jax.Array | None = None,
                 num_seqs: jax.Array | None = None,
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(valid_BxT, count_B, num_tokens, num_seqs) of a loss mask; the counts default to the
    mask's own (a microbatch passes its minibatch's) and are at least 1."""
    valid_BxT = mask_BxT.astype(bool)
    count_B = jnp.sum(valid_BxT, axis=1).astype(jnp.float32)
    if num_tokens is None:
        num_tokens = jnp.sum(count_B)
    num_tokens = jnp.maximum(jnp.asarray(num_tokens, jnp.float32), 1.0)
    if num_seqs is None:
        num_seqs = jnp.sum(count_B > 0)
    num_seqs = jnp.maximum(jnp.asarray(num_seqs, jnp.float32), 1.0)
    return valid_BxT, count_B, num_tokens, num_seqs


def aggregate_tokens(x_BxT: jax.Array, aggregation: Aggregation, count_B: jax.Array,
                     num_tokens: jax.Array, num_seqs: jax.Array,
                     max_completion_len: int | None) -> jax.Array:
    """A masked per-token term x_BxT reduced as `aggregation` says: Σ x / num_tokens
    (token_mean), or Σ_b (Σ_t x_bt / n_b) / num_seqs with n_b the row's tokens
    (seq_mean_token_mean), the constant max_completion_len (seq_mean_token_sum_norm) or 1
    (seq_mean_token_sum)."""
    if aggregation == "token_mean":
        return jnp.sum(x_BxT) / num_tokens
    if aggregation == "seq_mean_token_sum":
        return jnp.sum(x_BxT) / num_seqs
    if aggregation == "seq_mean_token_mean":
        per_seq_B = jnp.sum(x_BxT, axis=1) / jnp.maximum(count_B, 1.0)
    else:
        per_seq_B = jnp.sum(x_BxT, axis=1) / max_completion_len
    return jnp.sum(per_seq_B) / num_seqs


class _Tokens(typing.NamedTuple):
    """The valid tokens of one call and the denominators its per-token terms are reduced by."""

    valid_BxT: jax.Array
    count_B: jax.Array
    num_tokens: jax.Array
    num_seqs: jax.Array
    aggregation: Aggregation
    max_completion_len: int | None

    def masked(self, x_BxT: jax.Array) -> jax.Array:
        """x_BxT in float32 at least, 0 at the invalid tokens.

        Masking the *inputs* too keeps exp/expm1 of padding finite: a `where` after an
        overflow would still send 0 · inf = NaN back through the gradient."""
        return jnp.where(self.valid_BxT, _float(x_BxT), 0.0)

    def aggregate(self, x_BxT: jax.Array) -> jax.Array:
        """x_BxT masked and reduced as the loss's aggregation says (`aggregate_tokens`)."""
        return aggregate_tokens(self.masked(x_BxT), self.aggregation, self.count_B,
                                self.num_tokens, self.num_seqs, self.max_completion_len)

    def token_mean(self, x_BxT: jax.Array) -> jax.Array:
        """Σ_it m x_it / num_tokens: a metric's mean over the valid tokens."""
        return jnp.sum(self.masked(x_BxT)) / self.num_tokens


def _check_inputs(cfg: PolicyLossConfig, ref_logp_BxT: jax.Array | None,
                  sampler_logp_BxT: jax.Array | None, entropy_BxT: jax.Array | None,
                  max_completion_len: int | None) -> None:
    """Raises ValueError when cfg reads an input the call did not pass."""
    if cfg.beta > 0 and ref_logp_BxT is None:
        raise ValueError(f"beta={cfg.beta} > 0 adds a KL term: pass ref_logp_BxT")
    if cfg.uses_sampler_logp and sampler_logp_BxT is None:
        raise ValueError(f"correction={cfg.correction!r} with tis_cap={cfg.tis_cap} reads the "
                         f"sampler's log-probs: pass sampler_logp_BxT")
    if cfg.aggregation == "seq_mean_token_sum_norm":
        if max_completion_len is None or max_completion_len < 1:
            raise ValueError(f"aggregation='seq_mean_token_sum_norm' (Dr. GRPO) divides by a "
                             f"constant: pass max_completion_len >= 1, "
                             f"got {max_completion_len}")
    if cfg.entropy_bonus and entropy_BxT is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} > 0 (or entropy_target="
                         f"{cfg.entropy_target}) adds an entropy bonus: pass entropy_BxT")
    if cfg.top_entropy_quantile < 1 and entropy_BxT is None:
        raise ValueError("top_entropy_quantile < 1 keeps the high-entropy tokens: pass "
                         "entropy_BxT")


def _behaviour_ratio(old_logp_BxT: jax.Array, sampler_logp_BxT: jax.Array,
                     tis_cap: float | None, tok: _Tokens,
                     ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(rho_BxT, passed_BxT, async metrics) of the behaviour (sampler) policy against the
    proximal one, no gradient:

        rho_it = exp(old_logp_it - sampler_logp_it),  passed_it = [rho_it > tis_cap]
        async/kl_behaviour = token mean of rho - 1 - log rho   (k3 of KL(behaviour || proximal))
    """
    log_rho_BxT = tok.masked(old_logp_BxT) - tok.masked(sampler_logp_BxT)
    rho_BxT = jax.lax.stop_gradient(jnp.exp(log_rho_BxT))
    metrics = {"async/ratio_mean": tok.token_mean(rho_BxT)}
    passed_BxT = (rho_BxT > tis_cap) if tis_cap is not None else \
        jnp.zeros_like(tok.valid_BxT)
    metrics["async/ratio_clipped_frac"] = tok.token_mean(passed_BxT)
    metrics["async/kl_behaviour"] = tok.token_mean(
        jax.lax.stop_gradient(jnp.expm1(log_rho_BxT) - log_rho_BxT))
    return rho_BxT, passed_BxT, metrics


def _behaviour_weight(cfg: PolicyLossConfig, rho_BxT: jax.Array | None,
                      passed_BxT: jax.Array | None) -> jax.Array | None:
    """w_BxT, the behaviour correction's weight (None: 1):

        "tis"  min(rho, tis_cap),   "mis"  rho · [rho <= tis_cap],   "decoupled"  rho
    """
    if cfg.correction == "none" or not cfg.uses_sampler_logp:
        return None
    if cfg.correction == "tis":
        return jnp.minimum(rho_BxT, cfg.tis_cap)
    if cfg.correction == "mis":
        return jnp.where(passed_BxT, 0.0, rho_BxT)
    return rho_BxT


def _behaviour_correction(cfg: PolicyLossConfig, tok: _Tokens, old_logp_BxT: jax.Array,
                          sampler_logp_BxT: jax.Array | None,
                          ) -> tuple[jax.Array, jax.Array, jax.Array | None,
                                     dict[str, jax.Array]]:
    """(the ratio's old_logp, the behaviour's log-probs, w_BxT, metrics): with
    correction="none" the ratio's old_logp is the sampler's own (plain PPO against the policy
    that generated); the behaviour is the sampler when its log-probs are given."""
    metrics, rho_BxT, passed_BxT = {}, None, None
    if sampler_logp_BxT is not None:
        rho_BxT, passed_BxT, metrics = _behaviour_ratio(old_logp_BxT, sampler_logp_BxT,
                                                        cfg.tis_cap, tok)
    behaviour_logp_BxT = old_logp_BxT if sampler_logp_BxT is None else sampler_logp_BxT
    if cfg.correction == "none" and sampler_logp_BxT is not None:
        old_logp_BxT = sampler_logp_BxT
    w_BxT = _behaviour_weight(cfg, rho_BxT, passed_BxT)
    if w_BxT is not None:
        metrics["tis/weight_mean"] = tok.token_mean(w_BxT)
    return old_logp_BxT, behaviour_logp_BxT, w_BxT, metrics


def _importance_ratio(logp_BxT: jax.Array, old_logp_BxT: jax.Array, cfg: PolicyLossConfig,
                      count_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(token_log_ratio_BxT, ratio_BxT) of masked log-probs:

        token_log_ratio_it = logp_it - old_logp_it
        ratio_it = exp(token_log_ratio_it)                          "token"
                 = exp(sum_t token_log_ratio_it / |y_i|)            "sequence" (GSPO)
    """
    token_log_ratio_BxT = logp_BxT - old_logp_BxT
    log_ratio_BxT = token_log_ratio_BxT
    if cfg.importance_level == "sequence":
        seq_log_ratio_B = jnp.sum(log_ratio_BxT, axis=1) / jnp.maximum(count_B, 1.0)
        log_ratio_BxT = jnp.broadcast_to(seq_log_ratio_B[:, None], log_ratio_BxT.shape)
    return token_log_ratio_BxT, jnp.exp(log_ratio_BxT)


def _policy_term(cfg: PolicyLossConfig, tok: _Tokens, logp_BxT: jax.Array,
                 token_log_ratio_BxT: jax.Array, ratio_BxT: jax.Array, adv_Bx1: jax.Array,
                 w_BxT: jax.Array | None, behaviour_logp_BxT: jax.Array,
                 entropy_BxT: jax.Array | None,
                 ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(w_it · pg_it, the tokens the entropy bonus acts on, metrics): the surrogate
    (`loss_variants.surrogate_term`) weighted by the behaviour weight, then zeroed outside
    DeepSeek-V3.2's off-policy sequence mask and the top-entropy token mask when set."""
    vespo = cfg.surrogate == "vespo"
    pg_BxT, token_metrics = loss_variants.surrogate_term(
        cfg, logp_BxT, token_log_ratio_BxT, ratio_BxT, adv_Bx1, tok.valid_BxT,
        jnp.log(w_BxT) if vespo and w_BxT is not None else None)
    metrics = {name: tok.token_mean(x_BxT) for name, x_BxT in token_metrics.items()}
    if w_BxT is not None and not vespo:  # VESPO folds the weight into its own
        pg_BxT = pg_BxT * w_BxT
    if cfg.off_policy_kl_threshold is not None:
        keep = loss_variants.off_policy_sequence_mask(
            adv_Bx1, logp_BxT, tok.masked(behaviour_logp_BxT), tok.valid_BxT, tok.count_B,
            cfg.off_policy_kl_threshold)
        pg_BxT = jnp.where(keep, pg_BxT, 0.0)
        metrics["off_policy/masked_frac"] = tok.token_mean(
            ~jnp.broadcast_to(keep, tok.valid_BxT.shape))
    bonus_mask_BxT = tok.valid_BxT
    if cfg.top_entropy_quantile < 1:
        bonus_mask_BxT = loss_variants.top_entropy_mask(entropy_BxT, tok.valid_BxT,
                                                        cfg.top_entropy_quantile)
        pg_BxT = jnp.where(bonus_mask_BxT, pg_BxT, 0.0)
        metrics["entropy_mask/kept_frac"] = tok.token_mean(bonus_mask_BxT)
    return pg_BxT, bonus_mask_BxT, metrics


def _entropy_bonus(cfg: PolicyLossConfig, tok: _Tokens, per_token_BxT: jax.Array,
                   entropy_BxT: jax.Array, bonus_mask_BxT: jax.Array,
                   coef: jax.Array | float) -> tuple[jax.Array, jax.Array | float]:
    """(per_token_BxT, bonus) with the entropy bonus on the tokens of bonus_mask_BxT (K):
    "policy" subtracts coef · H_it from the per-token loss (aggregated like it); "tokens"
    returns the scalar bonus to subtract from the loss (module doc),

        bonus = coef · (sum_{it in K} H_it / |K|) · sum_it m_it / num_tokens   (q < 1)
              = coef · sum_{it in K} H_it / num_tokens                         (q = 1)
    """
    entropy_BxT = jnp.where(bonus_mask_BxT, entropy_BxT, 0.0)
    if cfg.entropy_aggregation == "policy":
        return per_token_BxT - coef * entropy_BxT, 0.0
    bonus_sum = jnp.sum(entropy_BxT)
    if cfg.top_entropy_quantile < 1:
        # This call's kept mean, weighted by its valid tokens: the calls of a minibatch then
        # sum to the minibatch's bonus, not M times it.
        bonus_sum = bonus_sum / jnp.maximum(jnp.sum(bonus_mask_BxT), 1.0) * \
            jnp.sum(tok.count_B)
    return per_token_BxT, coef * bonus_sum / tok.num_tokens


def policy_loss(logp_BxT: jax.Array, old_logp_BxT: jax.Array, adv_B: jax.Array,
                mask_BxT: jax.Array, cfg: PolicyLossConfig, *,
                ref_logp_BxT: jax.Array | None = None,
                sampler_logp_BxT: jax.Array | None = None,
                entropy_BxT: jax.Array | None = None,
                max_completion_len: int | None = None,
                num_tokens: jax.Array | None = None,
                num_seqs: jax.Array | None = None,
                entropy_coef: jax.Array | float | None = None,
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of the clipped surrogate objective; the equations are in the module doc.

    logp: the policy being trained; old_logp: the policy that the advantages belong to (the
    one before this batch's first update); sampler_logp: the sampler's own log-probs, for
    TIS; ref_logp: the frozen reference, for KL; entropy: the policy's per-token entropy
    (differentiable: the bonus's gradient flows through it).

    num_tokens, num_seqs: the denominators of the aggregations (valid tokens; sequences with
    a valid token) over a whole batch of which this call sees one microbatch; None counts
    this call's own. With the whole batch's counts, the losses, metrics and gradients of the
    microbatches sum to those of the batch (gradient accumulation ≡ full batch), but for
    top_entropy_quantile < 1, whose quantile is each call's own.

    entropy_coef: this update's coefficient of the bonus (a schedule's or the adaptive
    controller's value, may be traced), used only when cfg.entropy_bonus; None:
    cfg.entropy_coef.
    """
    _check_inputs(cfg, ref_logp_BxT, sampler_logp_BxT, entropy_BxT, max_completion_len)
    tok = _Tokens(*token_counts(mask_BxT, num_tokens, num_seqs), cfg.aggregation,
                  max_completion_len)

    old_logp_BxT, behaviour_logp_BxT, w_BxT, metrics = _behaviour_correction(
        cfg, tok, old_logp_BxT, sampler_logp_BxT)
    logp_BxT = tok.masked(logp_BxT)
    token_log_ratio_BxT, ratio_BxT = _importance_ratio(logp_BxT, tok.masked(old_logp_BxT),
                                                       cfg, tok.count_B)
    # One advantage per sequence [B], or per token [B, T] (PPO's GAE, `jaxrl.rl.gae`).
    adv_Bx1 = _float(adv_B)[:, None] if adv_B.ndim == 1 else tok.masked(adv_B)

    pg_BxT, bonus_mask_BxT, pg_metrics = _policy_term(
        cfg, tok, logp_BxT, token_log_ratio_BxT, ratio_BxT, adv_Bx1, w_BxT,
        behaviour_logp_BxT, entropy_BxT)
    metrics |= pg_metrics
    metrics["loss/policy"] = tok.aggregate(pg_BxT)
    per_token_BxT = pg_BxT

    metrics["loss/kl"] = jnp.zeros((), jnp.float32)
    if cfg.beta > 0:
        kl_BxT = kl_estimate(logp_BxT, tok.masked(ref_logp_BxT), cfg.kl_estimator, ratio_BxT)
        metrics["loss/kl"] = tok.aggregate(kl_BxT)
        per_token_BxT = per_token_BxT + cfg.beta * kl_BxT

    bonus = 0.0
    if entropy_BxT is not None:
        entropy_BxT = tok.masked(entropy_BxT)
        metrics["entropy"] = jnp.sum(entropy_BxT) / tok.num_tokens
        if cfg.entropy_bonus:
            coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
            per_token_BxT, bonus = _entropy_bonus(cfg, tok, per_token_BxT, entropy_BxT,
                                                  bonus_mask_BxT, coef)

    return tok.aggregate(per_token_BxT) - bonus, metrics
