"""The settings of the RL math that config holds besides the loss's (`loss_config`): how GRPO
scales its advantages, and the checks of a group size and of DAPO's overlong zone that a
config runs when it is made and the math (`advantages`, `shaping`) runs again on use."""

from __future__ import annotations

from typing import Literal

ScaleRewards = Literal["group", "batch", "none"]


def check_group_size(group_size: int) -> None:
    """Raises unless `group_size` >= 2: every estimator of `advantages` needs a group to
    compare with."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group-relative baseline needs at least "
                         f"two completions per prompt), got {group_size}")


def check_overlong(max_len: int, cache_len: int) -> None:
    """Raises unless the soft zone lies inside the budget: 1 <= cache_len <= max_len."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if not 1 <= cache_len <= max_len:
        raise ValueError(f"cache_len must be in [1, max_len={max_len}], got {cache_len}")
