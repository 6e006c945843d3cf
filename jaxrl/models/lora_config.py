"""What LoRA adapters a model has (`LoraConfig`) and the Hugging Face modules they may target;
the adapters themselves are `jaxrl.models.lora`, merging them into the kernels
`jaxrl.models.lora_merge`."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

# The HF projection modules an adapter can target, in a decoder layer's order.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = LORA_MODULES[:4]
MLP_MODULES = LORA_MODULES[4:]
# The HF module's parent inside a layer (`model.layers.N.<parent>.<module>`).
HF_PARENT = {m: "self_attn" if m in ATTENTION_MODULES else "mlp" for m in LORA_MODULES}

RolloutMode = Literal["merged", "on_the_fly"]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The adapters of a model: rank r, alpha (s = alpha / r), the HF modules they target,
    how the rollout applies them, and the seed that draws A."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rollout: RolloutMode = "merged"
    seed: int = 0

    def __post_init__(self):
        unknown = [t for t in self.targets if t not in LORA_MODULES]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {self.targets} must be a non-empty subset of "
                             f"{LORA_MODULES}")
        if self.rank < 1:
            raise ValueError(f"LoRA rank {self.rank} must be >= 1")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def match_targets(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """The HF modules (in `LORA_MODULES` order) that a pattern fully matches, by name
    (`q_proj`) or with its parent (`self_attn.q_proj`); each pattern must match one."""
    matched = set()
    for pattern in patterns:
        hits = {m for m in LORA_MODULES
                if re.fullmatch(pattern, m) or re.fullmatch(pattern, f"{HF_PARENT[m]}.{m}")}
        if not hits:
            raise ValueError(f"LoRA target pattern {pattern!r} matches none of "
                             f"{LORA_MODULES} (nor self_attn.* / mlp.* of them)")
        matched |= hits
    return tuple(m for m in LORA_MODULES if m in matched)
