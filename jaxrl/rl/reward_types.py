"""The two kinds of reward a `RewardSet` (`jaxrl.rl.rewards`) combines, and what an in-graph
one sees: `RewardInputs`, `JaxReward` (traced into the program) and `PythonReward` (called on
the host by `jaxrl.rl.host_rewards`), each checked when it is made. The set and the host
side both read these types; they read neither."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable
from typing import Any

import jax
from flax import struct

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
# Metric keys of the set itself, and of the step's reward shaping (reward/overlong).
_RESERVED = ("errors", "mean", "std", "overlong")


@struct.dataclass
class RewardInputs:
    """What a reward sees: tokens, masks, in-graph task fields [B, ...] and dataset rows."""

    prompt_ids_BxP: jax.Array
    prompt_mask_BxP: jax.Array
    completion_ids_BxC: jax.Array
    completion_mask_BxC: jax.Array
    fields: dict[str, jax.Array]
    rows_B: jax.Array


def _check_name_and_weight(kind: str, name: str, weight: float) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{kind} name must be non-empty and use only letters, digits, '_', '.' "
                         f"or '-' (it becomes the metric key reward/<name>), got {name!r}")
    if name in _RESERVED:
        raise ValueError(f"{kind} name {name!r} clashes with the metric reward/{name}; "
                         f"reserved names: {', '.join(_RESERVED)}")
    if (isinstance(weight, bool) or not isinstance(weight, numbers.Real)
            or not math.isfinite(weight)):
        raise ValueError(f"{kind} {name!r}: weight must be a finite number, got {weight!r}")


def _checked_bounds(kind: str, name: str, bounds: Any) -> tuple[float, float]:
    """`bounds` as (low, high) floats: two finite numbers, low < high."""
    try:
        low, high = bounds
    except (TypeError, ValueError):
        low = high = None
    if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
               for x in (low, high)) or not low < high:
        raise ValueError(f"{kind} {name!r}: bounds must be two finite numbers (low, high) with "
                         f"low < high, got {bounds!r}")
    return float(low), float(high)


@dataclasses.dataclass(frozen=True)
class JaxReward:
    """An in-graph reward: fn(RewardInputs) -> r_B float, traced into the program."""

    name: str
    fn: Callable[[RewardInputs], jax.Array]
    weight: float = 1.0
    bounds: tuple[float, float] = (0.0, 1.0)  # (low, high): other values are errors

    def __post_init__(self):
        _check_name_and_weight("JaxReward", self.name, self.weight)
        object.__setattr__(self, "bounds", _checked_bounds("JaxReward", self.name, self.bounds))
        if not callable(self.fn):
            raise ValueError(f"JaxReward {self.name!r}: fn must be callable, got {self.fn!r}")


@dataclasses.dataclass(frozen=True)
class PythonReward:
    """A host reward: fn(prompt text, completion text, task fields) -> float, per sample."""

    name: str
    fn: Callable[[str, str, dict[str, Any]], float]
    weight: float = 1.0
    bounds: tuple[float, float] = (0.0, 1.0)  # (low, high): other values are errors

    def __post_init__(self):
        _check_name_and_weight("PythonReward", self.name, self.weight)
        object.__setattr__(self, "bounds", _checked_bounds("PythonReward", self.name,
                                                           self.bounds))
        if not callable(self.fn):
            raise ValueError(f"PythonReward {self.name!r}: fn must be callable, got {self.fn!r}")


Reward = JaxReward | PythonReward
