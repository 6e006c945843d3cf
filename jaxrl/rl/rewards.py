"""Rewards: in-graph JAX rewards, host Python rewards, and their weighted sum.

A reward is one of two kinds:

    JaxReward     fn(RewardInputs) -> r_B float: runs inside the compiled program.
    PythonReward  fn(prompt: str, completion: str, fields: dict) -> float: runs on the host,
                  one sample per call.

A `RewardSet` combines them: total_B = Σ_k w_k · r_k,B, summed in the order the rewards were
given, so the same values always give the same bits. Its metrics are `reward/<name>` (the
unweighted batch mean of each reward), `reward/mean` and `reward/std` (population std) of the
total, and `reward/errors` (the number of failed Python calls in the batch).

The Python rewards of a set run together in one host function, `RewardSet.score_host`, which
decodes the prompt and completion ids to text with the injected `decode` callable, looks up
each sample's non-array task fields (answer strings...) by its dataset row with the injected
`host_fields` callable, and returns the per-reward values [K, B] and per-sample error counts
[B]. The two step modes call it differently and give identical totals:

    fused  `score(inputs)` calls it through one `jax.pure_callback` inside the program;
    split  the host calls `score_host(inputs)` between the two programs and passes the result
           to `score(inputs, host_values)`, which then runs no callback.

Under jit with inputs sharded over a mesh, the callback receives the whole (gathered) batch,
so its values do not depend on the sharding (single-process; a multi-host run uses split mode).

A Python reward that raises, or returns a non-number or a non-finite number, gives that sample
0 and counts one error; the first failure of each reward is logged with its traceback to the
logger "jaxrl.rewards", later ones are only counted, and the run goes on. A JAX reward cannot
fail per sample: a wrong output shape is a trace-time error that names the reward.

A sample is *solved* when its total is the highest a sample can earn, every reward at its best
(each lies in [0, 1]): max_total = Σ_k max(w_k, 0), a positive-weight reward at 1 and a
negative-weight one (a penalty) at 0. Training's per-prompt success (the curriculum) and
evaluation's exact match both use `RewardSet.solved`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import re
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

logger = logging.getLogger("jaxrl.rewards")

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
# Metric keys of the set itself, and of the step's reward shaping (reward/overlong).
_RESERVED = ("errors", "mean", "std", "overlong")


@struct.dataclass
class RewardInputs:
    """What a reward sees: tokens, masks, in-graph task fields [B, ...] and dataset rows."""

    prompt_ids_BxP: jax.Array
    prompt_mask_BxP: jax.Array
    completion_ids_BxC: jax.Array
    completion_mask_BxC: jax.Array
    fields: dict[str, jax.Array]
    rows_B: jax.Array


def _check_name_and_weight(kind: str, name: str, weight: float) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{kind} name must be non-empty and use only letters, digits, '_', '.' "
                         f"or '-' (it becomes the metric key reward/<name>), got {name!r}")
    if name in _RESERVED:
        raise ValueError(f"{kind} name {name!r} clashes with the metric reward/{name}; "
                         f"reserved names: {', '.join(_RESERVED)}")
    if (isinstance(weight, bool) or not isinstance(weight, numbers.Real)
            or not math.isfinite(weight)):
        raise ValueError(f"{kind} {name!r}: weight must be a finite number, got {weight!r}")


@dataclasses.dataclass(frozen=True)
class JaxReward:
    """An in-graph reward: fn(RewardInputs) -> r_B float, traced into the program."""

    name: str
    fn: Callable[[RewardInputs], jax.Array]
    weight: float = 1.0

    def __post_init__(self):
        _check_name_and_weight("JaxReward", self.name, self.weight)
        if not callable(self.fn):
            raise ValueError(f"JaxReward {self.name!r}: fn must be callable, got {self.fn!r}")


@dataclasses.dataclass(frozen=True)
class PythonReward:
    """A host reward: fn(prompt text, completion text, task fields) -> float, per sample."""

    name: str
    fn: Callable[[str, str, dict[str, Any]], float]
    weight: float = 1.0

    def __post_init__(self):
        _check_name_and_weight("PythonReward", self.name, self.weight)
        if not callable(self.fn):
            raise ValueError(f"PythonReward {self.name!r}: fn must be callable, got {self.fn!r}")


Reward = JaxReward | PythonReward
Decode = Callable[[np.ndarray, np.ndarray], list[str]]
HostFields = Callable[[np.ndarray], list[dict[str, Any]]]


@dataclasses.dataclass(frozen=True, eq=False)
class RewardSet:
    """Weighted rewards: `score` in the program, `score_host` between programs (module doc).

    decode(ids_BxT, mask_BxT) -> B texts (masked tokens dropped); host_fields(rows_B) -> B
    dicts of task fields. Both are needed only by Python rewards; host_fields may be None,
    and then every Python reward gets an empty dict.
    """

    rewards: Sequence[Reward]
    decode: Decode | None = None
    host_fields: HostFields | None = None
    _logged: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False,
                                              repr=False)

    def __post_init__(self):
        object.__setattr__(self, "rewards", tuple(self.rewards))
        if not self.rewards:
            raise ValueError("a RewardSet needs at least one reward")
        for r in self.rewards:
            if not isinstance(r, JaxReward | PythonReward):
                raise ValueError(f"rewards must be JaxReward or PythonReward, got {r!r}")
        names = [r.name for r in self.rewards]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward names must be unique, repeated: {', '.join(duplicates)}")
        if self.python_rewards and self.decode is None:
            raise ValueError(f"Python rewards {[r.name for r in self.python_rewards]} need a "
                             f"decode(ids_BxT, mask_BxT) -> list[str] callable, got None")

    @property
    def max_total(self) -> float:
        """The highest total a sample can earn: Σ_k max(w_k, 0)."""
        return float(sum(max(r.weight, 0.0) for r in self.rewards))

    def solved(self, total_B: Any) -> Any:
        """Whether each total is `max_total` (to float32 rounding); numpy or jax arrays."""
        return total_B >= self.max_total - 1e-6

    @property
    def python_rewards(self) -> tuple[PythonReward, ...]:
        """The host rewards, in the order given: the K rows of `score_host`'s values."""
        return tuple(r for r in self.rewards if isinstance(r, PythonReward))

    def score_host(self, inputs: RewardInputs) -> tuple[np.ndarray, np.ndarray]:
        """(values_KxB float32, errors_B float32) of the Python rewards, on the host."""
        out = self._host(np.asarray(inputs.prompt_ids_BxP), np.asarray(inputs.prompt_mask_BxP),
                         np.asarray(inputs.completion_ids_BxC),
                         np.asarray(inputs.completion_mask_BxC), np.asarray(inputs.rows_B))
        return out[:-1], out[-1]

    def score(self, inputs: RewardInputs,
              host_values: tuple[jax.Array, jax.Array] | None = None,
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(total_B, metrics), total_B = Σ_k w_k · r_k,B; jittable.

        host_values: `score_host`'s (values_KxB, errors_B), computed between programs (split
        mode); None runs the Python rewards through one `jax.pure_callback` (fused mode).
        """
        b = inputs.completion_ids_BxC.shape[0]
        k = len(self.python_rewards)
        if k and host_values is None:
            host_KxB = jax.pure_callback(
                self._host, jax.ShapeDtypeStruct((k + 1, b), jnp.float32),
                inputs.prompt_ids_BxP, inputs.prompt_mask_BxP, inputs.completion_ids_BxC,
                inputs.completion_mask_BxC, inputs.rows_B, vmap_method="sequential")
            values_KxB, errors_B = host_KxB[:k], host_KxB[k]
        elif k:
            values_KxB, errors_B = (jnp.asarray(v, jnp.float32) for v in host_values)
            if values_KxB.shape != (k, b) or errors_B.shape != (b,):
                raise ValueError(f"host_values must have shapes ({k}, {b}) and ({b},), got "
                                 f"{values_KxB.shape} and {errors_B.shape}")
        else:
            values_KxB, errors_B = jnp.zeros((0, b), jnp.float32), jnp.zeros((b,), jnp.float32)

        total_B = jnp.zeros((b,), jnp.float32)
        metrics = {}
        host_row = 0
        for reward in self.rewards:
            if isinstance(reward, PythonReward):
                r_B = values_KxB[host_row]
                host_row += 1
            else:
                r_B = jnp.asarray(reward.fn(inputs))
                if r_B.shape != (b,):
                    raise ValueError(f"JaxReward {reward.name!r} returned shape {r_B.shape}, "
                                     f"expected ({b},)")
                r_B = r_B.astype(jnp.float32)
            total_B = total_B + jnp.float32(reward.weight) * r_B
            metrics[f"reward/{reward.name}"] = jnp.mean(r_B)
        metrics["reward/errors"] = jnp.sum(errors_B)
        metrics["reward/mean"] = jnp.mean(total_B)
        metrics["reward/std"] = jnp.std(total_B)
        return total_B, metrics

    def _host(self, prompt_ids_BxP, prompt_mask_BxP, completion_ids_BxC, completion_mask_BxC,
              rows_B) -> np.ndarray:
        """[K + 1, B] float32: each Python reward's values, then the errors per sample."""
        python_rewards = self.python_rewards
        b = np.shape(completion_ids_BxC)[0]
        prompts = self.decode(np.asarray(prompt_ids_BxP), np.asarray(prompt_mask_BxP))
        completions = self.decode(np.asarray(completion_ids_BxC),
                                  np.asarray(completion_mask_BxC))
        if self.host_fields is None:
            fields = [{} for _ in range(b)]
        else:
            fields = self.host_fields(np.asarray(rows_B))
        for what, got in (("decode (prompts)", prompts), ("decode (completions)", completions),
                          ("host_fields", fields)):
            if len(got) != b:
                raise ValueError(f"{what} returned {len(got)} items for a batch of {b}")
        out = np.zeros((len(python_rewards) + 1, b), np.float32)
        for i, reward in enumerate(python_rewards):
            for j in range(b):
                value = self._call(reward, prompts[j], completions[j], fields[j])
                if value is None:
                    out[-1, j] += 1
                else:
                    out[i, j] = value
        return out

    def _call(self, reward: PythonReward, prompt: str, completion: str,
              fields: dict[str, Any]) -> float | None:
        """The reward's value as a float, or None (failure: logged if it is the first)."""
        try:
            value = reward.fn(prompt, completion, fields)
            if isinstance(value, np.bool_):
                value = bool(value)
            if not isinstance(value, numbers.Real):
                raise TypeError(f"returned {value!r} of type {type(value).__name__}, "
                                f"not a number")
            if not math.isfinite(value):
                raise ValueError(f"returned the non-finite value {value!r}")
            return float(value)
        except Exception:
            with self._lock:
                first = reward.name not in self._logged
                self._logged.add(reward.name)
            if first:
                logger.error("Python reward %r failed; the sample gets 0 and counts in "
                             "reward/errors (only this first failure is logged):\n%s",
                             reward.name, traceback.format_exc())
            return None
