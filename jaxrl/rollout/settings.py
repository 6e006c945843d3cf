"""The settings of the engine, apart from the engine: how a token is drawn (`SamplingParams`),
how the slots read the page pool (`PagedAttentionSettings`) and how a rollout batches and pages
(`EngineConfig`). Plain frozen dataclasses checked when made; the config sections are them
(`rollout.sampling`, `rollout.engine`, `eval.sampling`, `serve.sampling`: `jaxrl.config`)
without importing the engine. Their messages name the field alone (`top_k must be ...`): the
config loader puts the key of the section that raised before it."""

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
class PagedAttentionSettings:
    """How `generate` reads the pool: `xla` (gathers blocks of pages) or `pallas` (TPU);
    `unroll`: the XLA path's loop over blocks unrolled over every block, the same outputs
    (what FLOP accounting compiles: XLA's cost analysis counts a while body once)."""

    impl: Literal["xla", "pallas"] = "xla"
    pages_per_block: int = 8
    unroll: bool = False


Batching = Literal["continuous", "static"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and pages (the static part of one rollout call); the config's
    `rollout.engine` section itself."""

    # continuous: a slot whose row ends takes the next pending row; static: batches of
    # max_slots rows, each waiting for its longest row.
    batching: Batching = "continuous"
    max_slots: int | None = None  # decode slots; None: every row of the call at once
    page_size: int = 16  # tokens per KV page
    row_pages: int | None = None  # row pages in the pool; None: every slot's worst case
    # Continuous batching only: once no row waits, the live rows move into half as many slots
    # whenever they fit, down to min_slots (each halving compiles one more decode loop), so a
    # long tail of rows stops paying for free slots. None: the slot count never changes;
    # "auto": down to max(2, slots / 32) when rows may run 32 tokens or more, else never
    # (`slot_count.tail_min_slots`; in-flight pieces keep their slots).
    min_slots: int | Literal["auto"] | None = "auto"
    # auto: the TPU kernel (Pallas ragged_paged_attention) on TPU when it takes the shapes,
    # else the XLA path (blocks of pages up to the longest live row)
    attention: Literal["auto", "xla", "pallas"] = "auto"
    pages_per_block: int = 8  # pages the XLA path reads per block

    def __post_init__(self):
        for name in ("page_size", "pages_per_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_slots", "row_pages"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {getattr(self, name)}")
        if self.min_slots != "auto" and self.min_slots is not None and (
                isinstance(self.min_slots, str) or self.min_slots < 2):
            raise ValueError(f"min_slots must be >= 2, 'auto' or null, got {self.min_slots!r}")
        if self.min_slots not in (None, "auto") and self.batching == "static":
            raise ValueError(f"min_slots={self.min_slots} shrinks continuous batching's "
                             f"slots; with batching=static expected null")
        if self.attention not in ("auto", "xla", "pallas"):
            raise ValueError(f"attention must be 'auto', 'xla' or 'pallas', got "
                             f"{self.attention!r}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")

    @property
    def read(self) -> PagedAttentionSettings:
        return PagedAttentionSettings(self.attention, self.pages_per_block)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a rollout draws for each prompt: `num_generations` samples (the GRPO group), each
    turn at most `max_new_tokens` tokens drawn as `sampling` says, batched and paged as
    `engine` says (None: the dense reference sampler, `jaxrl.rollout.dense_reference`). Multi-turn
    (`jaxrl.step.multiturn_rollout`): at most `max_turns` policy turns, whose tokens and the
    observations between them fit `completion_budget` (`max_total_tokens`; None: max_turns x
    max_new_tokens); a single-turn call draws one turn.

    The config's `rollout` section is one (`jaxrl.config.sampling.RolloutSection`), so are the
    sampler's (`SamplerConfig`) and multi-turn's settings, made from it by `of`: its fields
    and their checks are written here once.
    """

    max_new_tokens: int = 64
    num_generations: int = 1
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    engine: EngineConfig | None = None
    max_turns: int = 1
    max_total_tokens: int | None = None

    def __post_init__(self):
        for name in ("max_new_tokens", "num_generations", "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.max_new_tokens:
            raise ValueError(f"max_total_tokens must be >= max_new_tokens="
                             f"{self.max_new_tokens} (one turn), or null, got "
                             f"{self.max_total_tokens}")

    @property
    def completion_budget(self) -> int:
        """C: completion tokens of a sample (all turns and observations when multi-turn)."""
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        return self.max_turns * self.max_new_tokens

    @classmethod
    def of(cls, generation: Generation, **more):
        """A `cls` with `generation`'s fields (a config's rollout section, say) and `more`."""
        return cls(**{field.name: getattr(generation, field.name)
                      for field in dataclasses.fields(Generation)}, **more)
