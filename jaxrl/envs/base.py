"""The environment protocol: what a multi-turn rollout talks to between the model's turns.

    env = make_env(row)              one environment per sample, from its dataset row
    obs = env.step(turn_text)        the model's turn (decoded text, stop tag included)
    obs.text / obs.ids               appended to the sample's sequence (masked out of the loss)
    obs.done, obs.reward             the episode ends; its reward (None: the task's rewards)

Environments run on the host, one call per turn, possibly in a worker thread while other
samples keep decoding; they must not share mutable state between samples.

The contract the rollout checks at every turn (`observation_problem`): `step` returns an
`Observation`, its `reward` is None or a finite number, its `text` None or a str; and `step`
returns within the run's time limit (`data.env_timeout_s`). A broken one ends the run with
`EnvFailure`, whose one-line message names the environment, the row and turn, and what was
expected: a user's plugin is found out by name instead of hanging or training on garbage.
Token ids outside the model's vocabulary (`Observation.ids`, or what its text encodes to:
`encoded_problem`) would be clamped by the embedding lookup: the rollout counts them and
never feeds them (the episode ends there; counted in `tool/errors`), logging the first
one's message to "jaxrl.envs".
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np


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


class EnvFailure(RuntimeError):
    """An environment failed or broke its contract during a rollout (module docstring):
    `problem` what happened, at batch row `row` (its `dataset_row` and the environment's
    `spec` once known) and policy turn `turn` (1-based; None: making the environment)."""

    def __init__(self, problem: str, *, row: int, turn: int | None = None,
                 spec: str | None = None, dataset_row: int | None = None):
        self.problem, self.row, self.turn = problem, row, turn
        self.spec, self.dataset_row = spec, dataset_row
        where = [f"data.env={spec!r}"] if spec is not None else []
        where.append(f"sample {row}" if dataset_row is None else
                     f"dataset row {dataset_row} (sample {row} of the batch)")
        if turn is not None:
            where.append(f"turn {turn}")
        super().__init__(f"{', '.join(where)}: {problem}")

    def at(self, spec: str, dataset_row: int) -> EnvFailure:
        """The same failure, naming the environment and the dataset row."""
        return EnvFailure(self.problem, row=self.row, turn=self.turn, spec=spec,
                          dataset_row=dataset_row)


def observation_problem(obs: object, vocab_size: int | None = None) -> str | None:
    """What `obs`, returned by `env.step`, breaks of the contract (module docstring); None
    when nothing. `vocab_size`: ids must be below it (None: not checked)."""
    if not isinstance(obs, Observation):
        return (f"env.step(turn) returned a {type(obs).__name__}; expected a "
                f"jaxrl.envs.Observation")
    reward = obs.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(reward)):
        return f"Observation.reward must be a finite number or None, got {reward!r}"
    if obs.text is not None and not isinstance(obs.text, str):
        return f"Observation.text must be a str or None, got a {type(obs.text).__name__}"
    if obs.ids is not None:
        ids = np.asarray(obs.ids)
        if ids.size and (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer)):
            return f"Observation.ids must be a sequence of int token ids, got {obs.ids!r:.80}"
        bad = ids[(ids < 0) | (ids >= vocab_size)] if vocab_size and ids.size else ids[:0]
        if bad.size:
            return (f"Observation.ids must be token ids in [0, {vocab_size}) (the model's "
                    f"vocabulary), got {bad[:5].tolist()}")
    return None


def encoded_problem(ids: Sequence[int], vocab_size: int | None) -> str | None:
    """What the token ids an observation's text encodes to break: ids outside the model's
    vocabulary, from a tokenizer that knows tokens the model's embedding has no row for (the
    lookup would clamp them silently); None when nothing (or `vocab_size` None)."""
    bad = [i for i in ids if not 0 <= i < vocab_size] if vocab_size else []
    if not bad:
        return None
    return (f"Observation.text encodes to token ids outside [0, {vocab_size}) (the model's "
            f"vocabulary): {bad[:5]}; the tokenizer knows tokens the model's embedding has "
            f"no row for")


def observation_ids(obs: Observation, encode: Callable[[str], list[int]],
                    limit: int | None = None) -> list[int]:
    """The tokens an observation appends: its ids, or its text encoded, or none; at most
    `limit` of them (None: all). A long text is cut by characters before it is encoded
    (`encode_prefix`)."""
    if obs.ids is not None:
        return [int(i) for i in obs.ids[:limit]]
    if not obs.text:
        return []
    return list(encode(obs.text)) if limit is None else encode_prefix(obs.text, encode, limit)


def encode_prefix(text: str, encode: Callable[[str], list[int]], limit: int) -> list[int]:
    """The first `limit` tokens of `text`, encoding only a prefix of it: 8 characters per
    token allowed at first (BPE vocabularies average 3-5 on text), doubled until the prefix
    gives more than `limit` tokens or is the whole text. Tokens near the cut could differ
    from the whole text's; taking one more token than kept keeps the cut away from them."""
    chars = 8 * (limit + 1)
    while True:
        ids = list(encode(text[:chars]))
        if len(ids) > limit or chars >= len(text):
            return ids[:limit]
        chars *= 2
