"""The `pass_rate` curriculum's weights (the sampler is `jaxrl.data.curriculum`).

    w_i = 1                                  prompt i never observed
    w_i = floor + (1 - floor) · v_i          v_i: its learning signal (moving average)
    v   = 1 - p^G - (1-p)^G                  the signal expected of binary rewards at pass
                                             rate p: the chance that G samples disagree
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PassRateConfig:
    """Knobs of the `pass_rate` curriculum (module docstring)."""

    group_size: int = 1  # G: samples per prompt (rollout.num_generations)
    floor: float = 0.3  # weight of a prompt whose groups always agree
    ema_weight: float = 0.5  # a: weight of the newest success value in a prompt's pass rate

    def __post_init__(self):
        if self.group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {self.group_size}")
        if not 0 < self.floor <= 1:
            raise ValueError(f"floor must be in (0, 1], got {self.floor}")
        if not 0 < self.ema_weight <= 1:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")


def binomial_signal(pass_N: np.ndarray, group_size: int) -> np.ndarray:
    """signal_N = 1 - p^G - (1-p)^G: the chance G Bernoulli(p) samples do not all agree."""
    return 1 - pass_N ** group_size - (1 - pass_N) ** group_size


def signal_weight(signal_N: np.ndarray, seen_N: np.ndarray, config: PassRateConfig
                  ) -> np.ndarray:
    """weight_N: 1 if unseen, else floor + (1 - floor) v."""
    return np.where(seen_N, config.floor + (1 - config.floor) * signal_N, 1.0)


def pass_rate_weight(pass_N: np.ndarray, seen_N: np.ndarray, config: PassRateConfig
                     ) -> np.ndarray:
    """weight_N of binary rewards: 1 if unseen, else floor + (1 - floor) (1 - p^G - (1-p)^G)."""
    return signal_weight(binomial_signal(pass_N, config.group_size), seen_N, config)
