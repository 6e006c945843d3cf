"""Host timestamps of phase boundaries inside compiled step programs.

    ids = clock.stamp("generated", after=rollout.num_steps, before=ids)   inside the jitted step

`stamp` records `time.perf_counter()` on the host (an `io_callback`) once `after` is
computed and returns `before` plus the callback's zero result: `after` makes the stamp wait
for the phase before it, and the phase after it, which reads the returned `before`, waits
for the stamp, so the compiler can neither hoist nor sink it. Each stamp costs one
device-to-host round trip (microseconds on CPU, about that of a small transfer on GPU/TPU).

The step appends one stamp per name per call; `pop()` takes the oldest stamp of each name,
so the loop, which fetches step N-1's metrics after dispatching step N, reads step N-1's.
"""

from __future__ import annotations

import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


class PhaseClock:
    """Named host timestamps recorded by the step programs (module docstring)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._stamps: dict[str, collections.deque[float]] = collections.defaultdict(
            collections.deque)
        self._lock = threading.Lock()

    def stamp(self, name: str, after: jax.Array, before: jax.Array) -> jax.Array:
        """(traced) Stamps `name` once `after` is computed; returns `before`, which now
        depends on the stamp (unchanged, and no stamp, when the clock is disabled)."""
        if not self.enabled:
            return before

        def record(_):
            now = time.perf_counter()
            with self._lock:
                self._stamps[name].append(now)
            return np.zeros((), np.int32)

        zero = io_callback(record, jax.ShapeDtypeStruct((), jnp.int32), after)
        return before + zero.astype(before.dtype)

    def record(self, name: str, seconds: float) -> None:
        """Adds a stamp taken on the host (`time.perf_counter()` seconds), e.g. by a thread
        that waited for a transfer."""
        with self._lock:
            self._stamps[name].append(seconds)

    def pop(self) -> dict[str, float]:
        """{name: seconds} of the oldest unread stamp of every name that has one."""
        with self._lock:
            return {name: q.popleft() for name, q in self._stamps.items() if q}


def phase_times(stamps: dict[str, float]) -> dict[str, float]:
    """time/generate_s (prompts in -> rollout complete) and time/train_s (train start ->
    last update done; the rollout's end in fused mode) from one step's stamps."""
    out = {}
    if "start" in stamps and "generated" in stamps:
        out["time/generate_s"] = stamps["generated"] - stamps["start"]
    train_start = stamps.get("train_start", stamps.get("generated"))
    if train_start is not None and "end" in stamps:
        out["time/train_s"] = stamps["end"] - train_start
    return out


def async_times(stamps: dict[str, float], previous: dict[str, float] | None
                ) -> dict[str, float]:
    """The asynchronous step's waits (`jaxrl.step.asynchronous`), from its stamps and the
    previous step's:

        time/weight_sync_s     synced - max(sync dispatched, previous update done)
        time/rollout_wait_s    this batch's generation start - the previous one's end
                               (rollout devices idle: the staleness bound, or the sync)
        time/train_wait_s      this train start - the previous update done (train devices
                               idle: the rollout was not ready, or host reward scoring)
    """
    out: dict[str, float] = {}
    if "synced" not in stamps:  # not the asynchronous step
        return out
    previous = previous or {}
    if "synced" in stamps and "sync_dispatch" in stamps:
        begin = max(stamps["sync_dispatch"], previous.get("end", -float("inf")))
        out["time/weight_sync_s"] = max(stamps["synced"] - begin, 0.0)
    if "start" in stamps and "generated" in previous:
        out["time/rollout_wait_s"] = max(stamps["start"] - previous["generated"], 0.0)
    if "train_start" in stamps and "end" in previous:
        out["time/train_wait_s"] = max(stamps["train_start"] - previous["end"], 0.0)
    return out


def step_seconds(stamps: dict[str, float], previous_end: float | None) -> float | None:
    """Seconds from the previous step's "end" stamp (or, for the first step, this step's
    "start") to this step's "end": the interval between step completions on the device's
    timeline, host stalls included, unaffected by when the host fetches the metrics."""
    if "end" not in stamps:
        return None
    begin = previous_end if previous_end is not None else stamps.get("start")
    return None if begin is None else stamps["end"] - begin
