"""The host side of a RewardSet: Python rewards scored on the host, and each reward's first error.

    score_python(rewards, decode, host_fields, errors, ids...) -> [K + 1, B] float32
        rows 0..K-1: each Python reward's values, NaN where its call failed; row K: the failed
        calls of each sample
    RewardErrors        the first failure of each reward, as text (thread-safe: the fused
                        program's callback runs in XLA's threads)

A call fails when the reward raises, or returns a non-number, a non-finite number or a number
outside the reward's declared `bounds` (compared in float32, the precision its values are
kept in, so 1.0000000000000002 counts as 1). The first failure of each reward is logged to
"jaxrl.rewards" (with the traceback when the reward raised) and remembered as one line: the
reward, an excerpt of the prompt and the completion, and what went wrong.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl.rl.reward_types import PythonReward

rewards_logger = logging.getLogger("jaxrl.rewards")

EXCERPT_CHARS = 60  # of a prompt or completion in an error's text


class RewardErrors:
    """The first error of each reward, as text, in the order they happened (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._texts: dict[str, str] = {}

    def note(self, name: str, text: str, details: str = "") -> None:
        """Remembers and logs `text` (and `details`, a traceback) if `name` had no error yet."""
        with self._lock:
            if name in self._texts:
                return
            self._texts[name] = text
        rewards_logger.error("%s; the sample gets 0 and counts in reward/errors (only the "
                             "first failure of each reward is logged)%s", text,
                             f"\n{details}" if details else "")

    @property
    def by_reward(self) -> dict[str, str]:
        """{reward name: its first error}, in the order the errors happened."""
        with self._lock:
            return dict(self._texts)

    @property
    def first(self) -> str | None:
        """The first error of any reward, or None."""
        with self._lock:
            return next(iter(self._texts.values()), None)


def format_bounds(bounds: tuple[float, float]) -> str:
    """"[0, 1]"."""
    return f"[{bounds[0]:g}, {bounds[1]:g}]"


class _BadValue(Exception):
    """A reward returned a value that is not one (its message says what it returned)."""


def score_python(rewards: Sequence[PythonReward], decode: Callable[..., list[str]],
                 host_fields: Callable[[np.ndarray], list[dict[str, Any]]] | None,
                 errors: RewardErrors, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxC,
                 completion_mask_BxC, rows_B) -> np.ndarray:
    """[K + 1, B] float32: each Python reward's values (NaN: failed), then failures per sample."""
    b = np.shape(completion_ids_BxC)[0]
    prompts = decode(np.asarray(prompt_ids_BxP), np.asarray(prompt_mask_BxP))
    completions = decode(np.asarray(completion_ids_BxC), np.asarray(completion_mask_BxC))
    fields = [{} for _ in range(b)] if host_fields is None else host_fields(np.asarray(rows_B))
    for what, got in (("decode (prompts)", prompts), ("decode (completions)", completions),
                      ("host_fields", fields)):
        if len(got) != b:
            raise ValueError(f"{what} returned {len(got)} items for a batch of {b}")
    out = np.zeros((len(rewards) + 1, b), np.float32)
    for i, reward in enumerate(rewards):
        for j in range(b):
            out[i, j] = call_reward(reward, prompts[j], completions[j], fields[j], errors)
    out[-1] = np.sum(np.isnan(out[:-1]), axis=0)
    return out


def call_reward(reward: PythonReward, prompt: str, completion: str, fields: dict[str, Any],
                errors: RewardErrors) -> float:
    """The reward's value as a float, or NaN when the call failed (module docstring)."""
    try:
        return _checked(reward.fn(prompt, completion, fields), reward.bounds)
    except _BadValue as e:
        what, details = str(e), ""
    except Exception as e:  # whatever the user's reward raises is a failed sample
        what, details = f"{type(e).__name__}: {e}", traceback.format_exc()
    errors.note(reward.name, f"PythonReward {reward.name!r} on prompt {_excerpt(prompt)} and "
                             f"completion {_excerpt(completion)}: {what}", details)
    return math.nan


def _checked(value: Any, bounds: tuple[float, float]) -> float:
    """`value` as a float if it is a finite number within `bounds`, else `_BadValue`."""
    if isinstance(value, np.bool_):
        value = bool(value)
    if not isinstance(value, numbers.Real):
        raise _BadValue(f"returned {_cut(repr(value))} of type {type(value).__name__}, "
                        f"not a number")
    value = float(value)
    if not math.isfinite(value):
        raise _BadValue(f"returned the non-finite value {value!r}")
    with np.errstate(over="ignore"):
        stored = np.float32(value)
    if not np.float32(bounds[0]) <= stored <= np.float32(bounds[1]):
        raise _BadValue(f"returned {value!r}, outside its declared range "
                        f"{format_bounds(bounds)}")
    return value


def _excerpt(text: str) -> str:
    """repr of `text` cut to EXCERPT_CHARS characters."""
    return repr(_cut(text))


def _cut(text: str) -> str:
    """`text`, its first EXCERPT_CHARS characters and "..." when it is longer."""
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."
