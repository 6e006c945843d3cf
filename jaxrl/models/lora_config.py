"""What LoRA adapters a model has (`LoraConfig`) and the Hugging Face modules they may target;
the adapters themselves are `jaxrl.models.lora`, merging them into the kernels
`jaxrl.models.lora_merge`."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, get_args

from jaxrl.config_base import fail, require_at_least

# The HF projection modules an adapter can target, in a decoder layer's order.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = LORA_MODULES[:4]
MLP_MODULES = LORA_MODULES[4:]
# The HF module's parent inside a layer (`model.layers.N.<parent>.<module>`).
HF_PARENT = {m: "self_attn" if m in ATTENTION_MODULES else "mlp" for m in LORA_MODULES}

RolloutMode = Literal["merged", "on_the_fly"]
_SECTION = "model.lora"  # where the config holds it: its messages name the key


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """`model.lora`: low-rank adapters on the projections, trained instead of the weights
    (`jaxrl.models.lora`): y = x W^T + (alpha / rank) · (x A^T) B^T. The config section
    itself (`jaxrl.config.model` holds it): one type and one set of checks, in the config's
    words, for the YAML key and for Python alike."""

    rank: int = 8
    alpha: float = 16.0
    # Regexes, each fully matching HF module names (q_proj ... down_proj) or parent.name
    # (self_attn.q_proj, mlp.up_proj); `.*_proj` targets all seven (`targets`: the matches).
    target_modules: tuple[str, ...] = LORA_MODULES
    # Only 0: dropout on the adapters' input would make the trainer's forward differ from
    # the sampler's (sampler == trainer log-probs) and from the old policy's of the same step.
    dropout: float = 0.0
    # How the rollout applies them: folded into the weights once per step (merged) or added
    # at every decoded token (on_the_fly); benchmarks/README.md measures both.
    rollout: RolloutMode = "merged"
    seed: int = 0  # draws A (B starts at 0: the adapted policy starts as the base)

    def __post_init__(self):
        require_at_least(_SECTION, self, ("rank",))
        if not self.alpha > 0:
            fail(_SECTION, self, "alpha", "> 0")
        if self.dropout != 0:
            fail(_SECTION, self, "dropout",
                 "0.0 (adapter dropout would break sampler == trainer log-probs)")
        if self.rollout not in get_args(RolloutMode):
            fail(_SECTION, self, "rollout", f"one of {get_args(RolloutMode)}")
        patterns = self.target_modules
        if isinstance(patterns, str) or not patterns:
            fail(_SECTION, self, "target_modules", f"a non-empty list of regexes of the "
                                                   f"modules to adapt, e.g. {list(LORA_MODULES)}")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                fail(_SECTION, self, "target_modules",
                     f"a list of valid regexes ({pattern!r} is not one: {e})")
        try:
            match_targets(tuple(patterns))
        except ValueError as e:
            fail(_SECTION, self, "target_modules", f"patterns that match modules ({e})")

    @property
    def targets(self) -> tuple[str, ...]:
        """The HF modules adapted (those `target_modules` match), in `LORA_MODULES` order."""
        return match_targets(tuple(self.target_modules))

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
