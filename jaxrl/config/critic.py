"""`algo.critic`: PPO's learned value model, used when `algo.advantage: gae`.

    kind        separate     a critic of its own: a copy of the policy's transformer
                             (initialised from the policy's weights) and a value head, trained
                             by its own optimizer (optim's schedule at `lr`)
                value_head   a value head on the policy's final hidden states: the value loss
                             (x vf_coef) is added to the policy loss and its gradient reaches
                             the shared trunk; the head alone has its own optimizer
    gamma, lam  GAE's discount and trace decay (`jaxrl.rl.gae`)
    value_clip  eps_v of the clipped value loss (None: unclipped)
    vf_coef     the value loss's weight in the summed loss
    warmup_steps  RL steps at the start that update only the critic (the policy stays as it
                is), so that the advantages come from a critic that has fitted something
    whiten_advantages  normalise the advantages over the valid tokens of each batch
    lr          the critic's peak learning rate (None: optim.lr)
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

from jaxrl.config_base import fail

CriticKind = Literal["separate", "value_head"]


@dataclasses.dataclass(frozen=True)
class CriticSection:
    """`algo.critic`: the value model of PPO (module docstring)."""

    kind: CriticKind = "separate"
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float | None = 0.2
    vf_coef: float = 0.5
    warmup_steps: int = 0
    whiten_advantages: bool = True
    lr: float | None = None

    def __post_init__(self):
        if self.kind not in typing.get_args(CriticKind):
            fail("algo.critic", self, "kind", f"one of {typing.get_args(CriticKind)}")
        for name in ("gamma", "lam"):
            if isinstance(getattr(self, name), bool) or not 0 <= getattr(self, name) <= 1:
                fail("algo.critic", self, name, "a number in [0, 1]")
        if self.value_clip is not None and not 0 < self.value_clip < math.inf:
            fail("algo.critic", self, "value_clip", "a finite number > 0, or None (unclipped)")
        if not 0 < self.vf_coef < math.inf:
            fail("algo.critic", self, "vf_coef", "a finite number > 0")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            fail("algo.critic", self, "warmup_steps", "an integer >= 0")
        if not isinstance(self.whiten_advantages, bool):
            fail("algo.critic", self, "whiten_advantages", "a bool")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            fail("algo.critic", self, "lr", "a finite number > 0, or None (optim.lr)")
