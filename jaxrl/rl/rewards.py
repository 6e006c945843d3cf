"""Rewards: in-graph JAX rewards, host Python rewards, and their weighted sum.

A reward is one of two kinds:

    JaxReward     fn(RewardInputs) -> r_B float: runs inside the compiled program.
    PythonReward  fn(prompt: str, completion: str, fields: dict) -> float: runs on the host,
                  one sample per call.

Every reward declares the range of its values, `bounds` = (low, high), (0, 1) by default.

A `RewardSet` combines them: total_B = Σ_k w_k · r_k,B, summed in the order the rewards were
given, so the same values always give the same bits. Its metrics are `reward/<name>` (the
unweighted batch mean of each reward), `reward/mean` and `reward/std` (population std) of the
total, `reward/errors/<name>` (the samples each reward failed on) and `reward/errors` (the
failed reward calls of the batch, all rewards together).

The Python rewards of a set run together in one host function, `RewardSet.score_host`, which
decodes the prompt and completion ids to text with the injected `decode` callable, looks up
each sample's non-array task fields (answer strings...) by its dataset row with the injected
`host_fields` callable, and returns the per-reward values [K, B] (NaN where a call failed)
and per-sample error counts [B] (`host_rewards.py`). The two step modes call it differently and give identical totals:

    fused  `score(inputs)` calls it through one `jax.pure_callback` inside the program;
    split  the host calls `score_host(inputs)` between the two programs and passes the result
           to `score(inputs, host_values)`, which then runs no callback.

Under jit with inputs sharded over a mesh, the callback receives the whole (gathered) batch,
so its values do not depend on the sharding (single-process; a multi-host run uses split mode).

A reward fails on a sample when it returns a value outside its bounds or a non-finite one
(checked in the program for a JAX reward), or, a Python reward, when it raises or returns a
non-number. The sample then gets 0 from that reward and the failure counts in the error
metrics; the run goes on (the training loop stops it when failures persist,
`train.reward_error_frac`). The set remembers the first error of each reward as one line of
text (`errors`, `first_error`) and logs it to "jaxrl.rewards": a Python reward's when it
happens (host_rewards.py), a JAX reward's when the host sees its step's metrics (`observe`).
A wrong output shape of a JAX reward is a trace-time error that names the reward.

A sample is *solved* when its total is the highest a sample can earn, every reward at its best:
max_total = Σ_k (w_k · high_k if w_k > 0 else w_k · low_k), a positive-weight reward at its
high bound and a negative-weight one (a penalty) at its low bound; with the default bounds
(0, 1), Σ_k max(w_k, 0). Training's per-prompt success (the curriculum) and evaluation's exact
match both use `RewardSet.solved`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rl.host_rewards import RewardErrors, format_bounds, score_python
from jaxrl.rl.reward_types import JaxReward, PythonReward, Reward, RewardInputs

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
    _errors: RewardErrors = dataclasses.field(default_factory=RewardErrors, init=False,
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
        """The highest total a sample can earn: Σ_k w_k · (high_k if w_k > 0 else low_k)."""
        return float(sum(r.weight * (r.bounds[1] if r.weight > 0 else r.bounds[0])
                         for r in self.rewards))

    def solved(self, total_B: Any) -> Any:
        """Whether each total is `max_total` (to float32 rounding); numpy or jax arrays."""
        return total_B >= self.max_total - 1e-6

    @property
    def python_rewards(self) -> tuple[PythonReward, ...]:
        """The host rewards, in the order given: the K rows of `score_host`'s values."""
        return tuple(r for r in self.rewards if isinstance(r, PythonReward))

    @property
    def errors(self) -> dict[str, str]:
        """{reward name: the text of its first error}, in the order the errors happened."""
        return self._errors.by_reward

    @property
    def first_error(self) -> str | None:
        """The text of the first error of any reward (module docstring), or None."""
        return self._errors.first

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        """Notes the first error of each JAX reward from a step's fetched metrics."""
        for r in self.rewards:
            failed = metrics.get(f"reward/errors/{r.name}", 0)
            if isinstance(r, JaxReward) and failed:
                self._errors.note(r.name, f"JaxReward {r.name!r} returned values outside "
                                          f"{format_bounds(r.bounds)} or non-finite on "
                                          f"{int(failed)} samples of step {step}")

    def score_host(self, inputs: RewardInputs) -> tuple[np.ndarray, np.ndarray]:
        """(values_KxB float32, NaN where a call failed; errors_B float32, the failed calls
        of each sample) of the Python rewards, on the host."""
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
        failed_KxB = jnp.isnan(values_KxB)
        values_KxB = jnp.where(failed_KxB, 0.0, values_KxB)

        total_B = jnp.zeros((b,), jnp.float32)
        metrics = {}
        host_row = 0
        for reward in self.rewards:
            if isinstance(reward, PythonReward):
                r_B, failed_B = values_KxB[host_row], failed_KxB[host_row]
                host_row += 1
            else:
                r_B = jnp.asarray(reward.fn(inputs))
                if r_B.shape != (b,):
                    raise ValueError(f"JaxReward {reward.name!r} returned shape {r_B.shape}, "
                                     f"expected ({b},)")
                r_B = r_B.astype(jnp.float32)
                low, high = (jnp.float32(x) for x in reward.bounds)
                failed_B = ~((r_B >= low) & (r_B <= high))  # NaN compares false: failed too
                r_B = jnp.where(failed_B, 0.0, r_B)
                errors_B = errors_B + failed_B
            total_B = total_B + jnp.float32(reward.weight) * r_B
            metrics[f"reward/{reward.name}"] = jnp.mean(r_B)
            metrics[f"reward/errors/{reward.name}"] = jnp.sum(failed_B, dtype=jnp.float32)
        metrics["reward/errors"] = jnp.sum(errors_B)
        metrics["reward/mean"] = jnp.mean(total_B)
        metrics["reward/std"] = jnp.std(total_B)
        return total_B, metrics

    def _host(self, *arrays) -> np.ndarray:
        """[K + 1, B] float32: `host_rewards.score_python` of the Python rewards."""
        return score_python(self.python_rewards, self.decode, self.host_fields, self._errors,
                            *arrays)
