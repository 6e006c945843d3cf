"""The sampling sections: `rollout` (training's samples) and `eval` (held-out evaluation).

Both draw tokens with temperature / top-k / top-p (`SamplingSection`, converted to the
sampler's `SamplingParams` in one place); `rollout` adds the group size and the completion
budget, `eval` which held-out prompts, how many samples each and pass@k.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config_base import fail, require_at_least
from jaxrl.rollout.settings import EngineConfig, SamplingParams


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    """temperature / top_k / top_p of a section named by `_section`."""

    _section = "sampling"  # a class attribute, not a config key
    temperature: float = 1.0  # 0 is greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        try:
            self.sampling_params()
        except ValueError as e:
            raise ValueError(f"{self._section}.{e}") from None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


@dataclasses.dataclass(frozen=True)
class RolloutSection(SamplingSection):
    """`rollout`: G samples per prompt, up to `max_new_tokens` each. The trainer scores every
    token at `temperature`, the distribution it was sampled from."""

    _section = "rollout"
    num_generations: int = 1  # samples per prompt (the GRPO group)
    max_new_tokens: int = 64
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # besides the EOS ids
    # No stop tokens at all, EOS included: every training completion has exactly
    # max_new_tokens tokens (benchmarks; vLLM's ignore_eos). Evaluation still stops at EOS.
    ignore_eos: bool = False
    # The engine (`jaxrl.rollout.slots`): decode slots over a paged KV cache. continuous:
    # a slot whose row ends takes the next pending row; static: batches of max_slots rows,
    # each waiting for its longest row. max_slots null: every row of the step at once.
    batching: Literal["continuous", "static"] = "continuous"
    max_slots: int | None = None
    page_size: int = 16  # tokens per KV page
    kv_pages: int | None = None  # row pages in the pool; null: every slot's worst case
    # Continuous batching only: once no row waits, the live rows move into half as many slots
    # whenever they fit, down to min_slots (each halving compiles one more decode loop), so a
    # long tail of rows stops paying for free slots. null: the slot count never changes;
    # auto: down to max(2, slots / 32) when rows may run 32 tokens or more, else never
    # (`slot_count.tail_min_slots`; in-flight pieces keep their slots).
    min_slots: int | str | None = "auto"
    # auto: the TPU kernel (Pallas ragged_paged_attention) on TPU when it takes the shapes,
    # else the XLA path (blocks of pages up to the longest live row)
    attention: Literal["auto", "xla", "pallas"] = "auto"
    # algo.mode=async with algo.max_staleness >= 2 only: a batch is generated in pieces over
    # the steps it waits for, each piece with the newest weights (PipelineRL's in-flight
    # weight updates; jaxrl.rollout.inflight). Each token records its weight version.
    inflight_updates: bool = False
    # Multi-turn (the task's environment or data.env; `jaxrl.step.multiturn_rollout`): policy turns
    # per sample, max_new_tokens each, and the completion's budget over all turns and the
    # observations between them (null: max_turns x max_new_tokens).
    max_turns: int = 1
    max_total_tokens: int | None = None

    def __post_init__(self):
        require_at_least("rollout", self, ("num_generations", "max_new_tokens", "page_size",
                                           "max_turns"))
        if self.max_total_tokens is not None and self.max_total_tokens < self.max_new_tokens:
            fail("rollout", self, "max_total_tokens", f">= rollout.max_new_tokens="
                                                      f"{self.max_new_tokens} (one turn), or null")
        require_at_least("rollout", self, ("max_slots", "kv_pages"), 1, " or null")
        if self.min_slots != "auto":
            if isinstance(self.min_slots, str):
                fail("rollout", self, "min_slots", "an integer >= 2, 'auto' or null")
            require_at_least("rollout", self, ("min_slots",), 2, ", 'auto' or null")
        try:
            self.engine_config()  # the engine's own checks of how its settings combine
        except ValueError as e:
            raise ValueError(f"rollout.{e}") from None
        if self.inflight_updates and self.min_slots not in (None, "auto"):
            raise ValueError(f"rollout.inflight_updates=true keeps a rollout's slot count "
                             f"between its pieces, but rollout.min_slots={self.min_slots}; "
                             f"expected null or 'auto'")
        if self.ignore_eos and self.stop_token_ids:
            raise ValueError(f"rollout.ignore_eos=true stops on no token, but "
                             f"rollout.stop_token_ids={list(self.stop_token_ids)}; expected []")
        super().__post_init__()

    @property
    def completion_budget(self) -> int:
        """C: completion tokens of a sample (all turns and observations when multi-turn)."""
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        return self.max_turns * self.max_new_tokens

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_slots=self.max_slots, page_size=self.page_size,
                            batching=self.batching, attention=self.attention,
                            row_pages=self.kv_pages, min_slots=self.min_slots)


@dataclasses.dataclass(frozen=True)
class EvalSection(SamplingSection):
    """`eval`: held-out prompts, n samples each, scored by the task's rewards
    (`jaxrl.run.evaluate`). Training evaluates at the end (and every `every` steps);
    `jaxrl eval` on demand."""

    _section = "eval"
    temperature: float = 0.0  # greedy
    num_prompts: int = 1000  # held-out prompts (the task's eval rows); 0: no evaluation
    batch_size: int = 250  # prompts per sampler call (x num_samples completions)
    num_samples: int = 1  # completions per prompt (n of pass@k)
    k: list[int] = dataclasses.field(default_factory=lambda: [1])  # eval/pass@k for each
    every: int = 0  # training evaluates every N steps too; 0: only at the end
    seed: int = 0  # which held-out prompts, and the sampling keys (the same at every eval)

    def __post_init__(self):
        require_at_least("eval", self, ("num_prompts",), 0, " (0: no evaluation)")
        require_at_least("eval", self, ("batch_size", "num_samples"))
        require_at_least("eval", self, ("every", "seed"), 0)
        super().__post_init__()
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"eval.num_samples={self.num_samples} needs eval.temperature > 0, "
                             f"got 0 (greedy samples of a prompt would all be identical)")
        if not self.k or len(set(self.k)) != len(self.k):
            fail("eval", self, "k", "a non-empty list of distinct sample counts")
        if not all(1 <= k <= self.num_samples for k in self.k):
            fail("eval", self, "k", f"a list of values in [1, eval.num_samples="
                                    f"{self.num_samples}]")
