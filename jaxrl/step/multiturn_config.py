"""The static shape of a multi-turn rollout (`jaxrl.step.multiturn_rollout`): the rollout's
limits (a `Generation`, the config's rollout section itself), the stop ids, the slots and the
environments' threads and time limit; its KV pool (`layout`) and the device-side stops."""

from __future__ import annotations

import dataclasses

from jaxrl.rollout import slots
from jaxrl.rollout.pages import PoolLayout
from jaxrl.rollout.settings import EngineConfig, Generation, PagedAttentionSettings


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """The static shape of a multi-turn rollout.

    generation: the rollout's limits (`jaxrl.rollout.settings.Generation`, the config's
    rollout section): `max_turns` policy turns per episode, `max_new_tokens` tokens of one
    turn (`max_turn_tokens`), C = `completion_budget` completion tokens per row, turns and
    observations (`max_total_tokens`), the engine's settings (`engine`: its page size and how
    the slots read the pool, as a single-turn rollout's); its sampling and group size are the
    call's unless it names none (evaluation names its own).
    turn_end_token_ids: end a turn (the tool call's end tags, the config's
    `rollout.stop_token_ids`); eos_token_ids (added to them) also
    end the episode after the environment saw the turn. num_slots: rows decoded at once.
    chunk_width: tokens per `extend` call (an observation longer than chunk_width - 1 takes
    several). env_workers: threads running `env.step` (None: num_slots). env_timeout_s: the
    longest one `env.step` call may take (None: no limit).
    """

    generation: Generation
    num_slots: int = 8
    turn_end_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    chunk_width: int = 64
    pad_token_id: int = 0
    env_workers: int | None = None
    env_timeout_s: float | None = None

    def __post_init__(self):
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.chunk_width < 2:
            raise ValueError(f"chunk_width must be >= 2, got {self.chunk_width}")
        if self.env_timeout_s is not None and not self.env_timeout_s > 0:
            raise ValueError(f"env_timeout_s must be > 0 or None, got {self.env_timeout_s}")

    @property
    def max_turns(self) -> int:
        return self.generation.max_turns

    @property
    def max_turn_tokens(self) -> int:
        return self.generation.max_new_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.generation.completion_budget

    @property
    def engine(self) -> EngineConfig:
        """The rollout's engine settings (the defaults when the generation names none)."""
        return self.generation.engine or EngineConfig()

    @property
    def page_size(self) -> int:
        return self.engine.page_size

    @property
    def attention(self) -> PagedAttentionSettings:
        """How the slots read the pool: the engine's kernel (`auto` is resolved for the pool's
        shapes when the slots are made) and pages per block."""
        return self.engine.read

    @property
    def stops(self) -> slots.Stops:
        """EOS ends the row (on the device: its pages go back); a stop token or the turn's
        `max_turn_tokens`-th token ends the turn; `max_total_tokens` is each row's limit."""
        return slots.Stops(row_ids=tuple(self.eos_token_ids),
                           turn_ids=tuple(dict.fromkeys(self.turn_end_token_ids + self.eos_token_ids)),
                           turn_tokens=self.max_turn_tokens)

    def layout(self, prompt_len: int, num_slots: int) -> PoolLayout:
        """A pool of `num_slots` slots (one device's): one prompt home per slot, and row
        pages for every slot's whole budget at once."""
        return PoolLayout.plan(page_size=self.page_size, num_prompts=num_slots,
                               prompt_len=prompt_len, max_new_tokens=self.max_total_tokens,
                               num_slots=num_slots)
