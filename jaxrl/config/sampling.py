"""The sampling sections: `rollout` (training's samples) and `eval` (held-out evaluation).

Both draw tokens as `sampling` says: that key is the sampler's own `SamplingParams`
(`jaxrl.rollout.settings`: temperature / top_k / top_p, checked there once). `rollout` is the
engine's own `Generation` (group size, token caps, turns and budget, `sampling`, and
`rollout.engine`: the engine's `EngineConfig`), plus the stop tokens and in-flight updates;
`eval` says which held-out prompts, how many samples each and pass@k.
"""

from __future__ import annotations

import dataclasses

from jaxrl.config_base import fail, require_at_least
from jaxrl.rollout.settings import EngineConfig, Generation, SamplingParams


@dataclasses.dataclass(frozen=True)
class RolloutSection(Generation):
    """`rollout`: G samples per prompt, up to `max_new_tokens` each (multi-turn: per turn,
    `max_turns` turns within `max_total_tokens`): the engine's own `Generation`, its keys and
    checks there. The trainer scores every token at `sampling.temperature`, the distribution
    it was sampled from."""

    # The user's stop ids, besides the EOS ids: they end a completion (the sampler's
    # `SamplerConfig.end_token_ids`), in a multi-turn run a turn (`MultiTurnConfig.turn_end_token_ids`).
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    # No stop tokens at all, EOS included: every training completion has exactly
    # max_new_tokens tokens (benchmarks; vLLM's ignore_eos). Evaluation still stops at EOS.
    ignore_eos: bool = False
    # The engine (`jaxrl.rollout.slots`): decode slots over a paged KV cache, batching,
    # the tail's slot halving, the attention path (`jaxrl.rollout.settings.EngineConfig`).
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    # algo.mode=async with algo.max_staleness >= 2 only: a batch is generated in pieces over
    # the steps it waits for, each piece with the newest weights (PipelineRL's in-flight
    # weight updates; jaxrl.rollout.inflight). Each token records its weight version.
    inflight_updates: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.inflight_updates and self.engine.min_slots not in (None, "auto"):
            raise ValueError(f"rollout.inflight_updates=true keeps a rollout's slot count "
                             f"between its pieces, but rollout.engine.min_slots="
                             f"{self.engine.min_slots}; expected null or 'auto'")
        if self.ignore_eos and self.stop_token_ids:
            raise ValueError(f"rollout.ignore_eos=true stops on no token, but "
                             f"rollout.stop_token_ids={list(self.stop_token_ids)}; expected []")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """`eval`: held-out prompts, n samples each, scored by the task's rewards
    (`jaxrl.run.evaluate`). Training evaluates at the end (and every `every` steps);
    `jaxrl eval` on demand."""

    # greedy by default
    sampling: SamplingParams = dataclasses.field(
        default_factory=lambda: SamplingParams(temperature=0.0))
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
        if self.num_samples > 1 and self.sampling.greedy:
            raise ValueError(f"eval.num_samples={self.num_samples} needs "
                             f"eval.sampling.temperature > 0, got 0 (greedy samples of a "
                             f"prompt would all be identical)")
        if not self.k or len(set(self.k)) != len(self.k):
            fail("eval", self, "k", "a non-empty list of distinct sample counts")
        if not all(1 <= k <= self.num_samples for k in self.k):
            fail("eval", self, "k", f"a list of values in [1, eval.num_samples="
                                    f"{self.num_samples}]")
