"""The environment protocol: what a multi-turn rollout talks to between the model's turns.

    env = make_env(row)              one environment per sample, from its dataset row
    obs = env.step(turn_text)        the model's turn (decoded text, stop tag included)
    obs.text / obs.ids               appended to the sample's sequence (masked out of the loss)
    obs.done, obs.reward             the episode ends; its reward (None: the task's rewards)

Environments run on the host, one call per turn, possibly in a worker thread while other
samples keep decoding; they must not share mutable state between samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class ToolStats:
    """What the tools of one turn did: calls made, calls that failed (an error observation),
    calls stopped by their time limit, and the seconds they took in all."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    latency_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Observation:
    """The environment's answer to one turn. Exactly one of `text` (tokenized by the rollout
    without special-token handling) and `ids` (token ids as they are) may be set; neither
    means nothing is appended. `done` ends the episode after this observation (which is then
    not appended); `reward`, when given with `done`, is the episode's reward."""

    text: str | None = None
    ids: Sequence[int] | None = None
    done: bool = False
    reward: float | None = None
    tools: ToolStats = ToolStats()

    def __post_init__(self):
        if self.text is not None and self.ids is not None:
            raise ValueError("an Observation has text or ids, not both")


class Environment(Protocol):
    def step(self, turn: str) -> Observation:
        """The model's turn (decoded) -> what comes back."""
        ...


EnvFactory = Callable[[Mapping[str, Any]], Environment]  # a dataset row -> its environment
