"""What `jaxrl.rl.losses.policy_loss` computes: `PolicyLossConfig`, the member of the GRPO
family and its variants (`jaxrl.rl.loss_variants`), checked when it is made. The losses and
the variants read it; it reads neither, so both can import it."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

ImportanceLevel = Literal["token", "sequence"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm",
                      "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k2", "k3", "k3_ratio"]
Correction = Literal["tis", "mis", "decoupled", "none"]
Surrogate = Literal["ppo_clip", "cispo", "sapo", "vespo"]
EntropyAggregation = Literal["policy", "tokens"]


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Which member of the GRPO family `policy_loss` computes (see the module docstring)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    importance_level: ImportanceLevel = "token"
    aggregation: Aggregation = "token_mean"
    beta: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    correction: Correction = "tis"  # how the behaviour (sampler) policy is corrected for
    entropy_aggregation: EntropyAggregation = "policy"
    # The variants of `jaxrl.rl.loss_variants` (its docstring has their equations).
    surrogate: Surrogate = "ppo_clip"
    negative_adv_ratio_cap: float | None = None  # TRL delta, verl clip_ratio_c
    cispo_ratio_cap: float = 5.0  # TRL epsilon_high with loss_type="cispo"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_kl_threshold: float | None = None  # TRL off_policy_mask_threshold
    top_entropy_quantile: float = 1.0  # 1: every token
    # The adaptive entropy coefficient (None: constant entropy_coef); TRL use_adaptive_entropy.
    entropy_target: float | None = None
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0

    def __post_init__(self):
        for name, choices in (("importance_level", ImportanceLevel),
                              ("aggregation", Aggregation), ("kl_estimator", KLEstimator),
                              ("correction", Correction), ("surrogate", Surrogate),
                              ("entropy_aggregation", EntropyAggregation)):
            value = getattr(self, name)
            if value not in typing.get_args(choices):
                raise ValueError(f"{name} must be one of {typing.get_args(choices)}, "
                                 f"got {value!r}")
        # `not x >= 0` also rejects NaN.
        if not 0 <= self.epsilon_low <= 1:
            raise ValueError(f"epsilon_low must be in [0, 1] (the ratio is clipped below at "
                             f"1 - epsilon_low), got {self.epsilon_low}")
        if not 0 <= self.epsilon_high < math.inf:
            raise ValueError(f"epsilon_high must be finite and >= 0, got {self.epsilon_high}")
        if not 0 <= self.beta < math.inf:
            raise ValueError(f"beta must be finite and >= 0 (0 = no KL term), got {self.beta}")
        if not 0 <= self.entropy_coef < math.inf:
            raise ValueError(f"entropy_coef must be finite and >= 0 (a bonus), "
                             f"got {self.entropy_coef}")
        if self.tis_cap is not None and not 0 < self.tis_cap < math.inf:
            raise ValueError(f"tis_cap must be finite and > 0, or None (off), got {self.tis_cap}")
        if self.correction == "mis" and self.tis_cap is None:
            raise ValueError("correction='mis' masks tokens whose weight passes tis_cap: set "
                             "tis_cap (e.g. 2.0)")
        if self.correction in ("decoupled", "none") and self.tis_cap is not None:
            raise ValueError(f"correction={self.correction!r} takes no cap, got tis_cap="
                             f"{self.tis_cap} (a capped weight is correction='tis')")
        _check_variants(self)

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss has an entropy bonus (a coefficient, or an adaptive one)."""
        return self.entropy_coef > 0 or self.entropy_target is not None

    @property
    def uses_sampler_logp(self) -> bool:
        """Whether the loss reads the sampler's log-probs."""
        return self.correction != "tis" or self.tis_cap is not None


def _check_variants(cfg: PolicyLossConfig) -> None:
    """ValueError naming the first bad variant setting of `cfg`."""
    cap = cfg.negative_adv_ratio_cap
    if cap is not None and not (cfg.surrogate == "ppo_clip"
                                and 1 + cfg.epsilon_high < cap < math.inf):
        raise ValueError(f"negative_adv_ratio_cap caps the ratio of surrogate='ppo_clip' "
                         f"past its clip: it must be finite and > 1 + epsilon_high = "
                         f"{1 + cfg.epsilon_high} (e.g. 3.0), or None, got {cap} with "
                         f"surrogate={cfg.surrogate!r}")
    positive = ("cispo_ratio_cap", "sapo_temperature_pos", "sapo_temperature_neg",
                "vespo_lambda_pos", "vespo_lambda_neg", "entropy_coef_delta")
    for name in positive + ("vespo_k_pos", "vespo_k_neg", "entropy_coef_min",
                            "entropy_coef_max"):
        value = getattr(cfg, name)
        if not (0 < value if name in positive else 0 <= value) or not value < math.inf:
            raise ValueError(f"{name} must be finite and {'>' if name in positive else '>='}"
                             f" 0, got {value}")
    if cfg.surrogate == "vespo" and cfg.importance_level != "token":
        raise ValueError("surrogate='vespo' weighs whole sequences by the product of their "
                         "token ratios: importance_level must be 'token'")
    for name in ("off_policy_kl_threshold", "entropy_target"):
        value = getattr(cfg, name)
        if value is not None and not 0 <= value < math.inf:
            raise ValueError(f"{name} must be finite and >= 0, or None (off), got {value}")
    if not 0 <= cfg.top_entropy_quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in [0, 1] (1: every token), "
                         f"got {cfg.top_entropy_quantile}")
    if cfg.entropy_target is not None:
        if cfg.entropy_coef_min > cfg.entropy_coef_max:
            raise ValueError(f"entropy_coef_min={cfg.entropy_coef_min} must be <= "
                             f"entropy_coef_max={cfg.entropy_coef_max}")
        if cfg.top_entropy_quantile < 1:
            raise ValueError("entropy_target measures the entropy of every valid token: "
                             "top_entropy_quantile must be 1 with it")
