"""The settings of the engine, apart from the engine: how a token is drawn (`SamplingParams`),
how the slots read the page pool (`Attention`) and how a rollout batches and pages
(`EngineConfig`). Plain frozen dataclasses checked when made; the config sections hold them
(`jaxrl.config.sampling`) without importing the engine."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one token is drawn from the logits. `temperature == 0` is greedy."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.temperature >= 0:  # also rejects NaN, which would sample garbage silently
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or null, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or null, got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class Attention:
    """How `generate` reads the pool: `xla` (gathers blocks of pages) or `pallas` (TPU);
    `unroll`: the XLA path's loop over blocks unrolled over every block, the same outputs
    (what FLOP accounting compiles: XLA's cost analysis counts a while body once)."""

    impl: Literal["xla", "pallas"] = "xla"
    pages_per_block: int = 8
    unroll: bool = False


Batching = Literal["continuous", "static"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and pages (the static part of one rollout call)."""

    max_slots: int | None = None  # None: every row at once
    page_size: int = 16
    batching: Batching = "continuous"
    attention: Literal["auto", "xla", "pallas"] = "auto"
    pages_per_block: int = 8
    row_pages: int | None = None  # None: every slot's worst case fits at once
    # The tail halving (`rollout`): halve down to this; None: the slot count stays; "auto":
    # `slot_count.tail_min_slots` chooses from the call's shapes.
    min_slots: int | Literal["auto"] | None = "auto"

    def __post_init__(self):
        if self.max_slots is not None and self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1 or None, got {self.max_slots}")
        if self.min_slots != "auto" and self.min_slots is not None and (
                isinstance(self.min_slots, str) or self.min_slots < 2):
            raise ValueError(f"min_slots must be >= 2, 'auto' or None, got {self.min_slots!r}")
        if self.min_slots not in (None, "auto") and self.batching == "static":
            raise ValueError(f"min_slots={self.min_slots} shrinks continuous batching's "
                             f"slots; with batching=static expected None")
        if self.attention not in ("auto", "xla", "pallas"):
            raise ValueError(f"attention must be 'auto', 'xla' or 'pallas', got "
                             f"{self.attention!r}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")

    @property
    def read(self) -> Attention:
        return Attention(self.attention, self.pages_per_block)
