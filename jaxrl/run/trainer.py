"""The trainer: `steps()` runs the steps and yields each step's record one step late; the
periodic work of a run is a list of hooks (`jaxrl.run.hooks`).

    trainer = Trainer(started, recorder, hooks, max_steps)
    for step, record in trainer.steps():   step N's record, made after step N+1 was dispatched
        ...                                (the host logs while the device works: nanodo's way)

Each step: dispatch step N (the step call returns at once; the state is donated and carried),
make step N-1's record (fetching it waits for N-1 only), then, in the hooks' order, every
hook that is due after N+1 steps (`Hook.due`) runs `after_step`; one that reads the run's
state as of step N (`needs_record`: a checkpoint holds the curriculum's view of N, an
evaluation follows it in the log) gets step N's record made first. Every record goes through
each hook's `on_record`, in order. A hook that sets `trainer.stopping` (preemption) ends the
loop after the remaining hooks of that step ran. Step N-1's record is made even when step N
failed or was interrupted, but not again when making it was what failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx

from jaxrl.run.recorder import StepRecorder
from jaxrl.run.start import Started


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A step's output as fetched to the host, and its batch's prompt positions."""

    out: Any  # jaxrl.step.StepOutput of numpy arrays
    positions_B: Any


class Hook:
    """Periodic work of a run. Subclasses override what they need; a hook may also be a
    context manager, entered around the whole loop (a progress display)."""

    needs_record = False  # after_step needs the step's own record made first

    def due(self, trainer: Trainer, done: int) -> bool:
        """Whether `after_step` runs once `done` steps are done (called once per step)."""
        return False

    def after_step(self, trainer: Trainer, done: int) -> None:
        """Work after `done` steps were dispatched (trainer.state holds their result)."""

    def on_record(self, trainer: Trainer, step: int, record: dict[str, Any],
                  fetched: Fetched) -> None:
        """Step `step`'s metrics `record` (as logged) and its fetched output."""


def every(n: int, done: int) -> bool:
    """The `every=n` rule: after each n-th step (n <= 0: never)."""
    return n > 0 and done % n == 0


class Trainer:
    """Steps one started run with its hooks (module docstring)."""

    def __init__(self, started: Started, recorder: StepRecorder, hooks: Sequence[Hook],
                 max_steps: int):
        self.started, self.run, self.recorder = started, started.run, recorder
        self.hooks, self.max_steps = tuple(hooks), max_steps
        self.state: nnx.State = started.state
        # Each step's prompt positions (for the curriculum) and data metrics, at its draw
        # (async mode draws algo.max_staleness steps ahead).
        self.drawn: dict[int, tuple[Any, dict[str, float]]] = dict(started.drawn)
        self.stopping = False  # set by a hook: end after this step's hooks
        self.stopped: int | None = None  # the step count a stop ended the run at
        self._attempted = -1  # the last step whose record was begun

    @property
    def seconds(self) -> float:
        """Seconds since the first dispatch."""
        return time.perf_counter() - self.recorder.start

    def steps(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(step, record) of each step from `started.start_step`, one step late (above)."""
        pending: tuple[int, Any] | None = None
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                if isinstance(hook, contextlib.AbstractContextManager):
                    stack.enter_context(hook)
            try:
                for step in range(self.started.start_step, self.max_steps):
                    self.state, out = self.run.step(self.state, step, self._batch_of,
                                                            self.run.ref_params)
                    if pending is not None:
                        yield self._record(*pending)
                    pending, done = (step, out), step + 1
                    for hook in self.hooks:
                        if not hook.due(self, done):
                            continue
                        if hook.needs_record and pending is not None:
                            record, pending = self._record(*pending), None
                            yield record
                        hook.after_step(self, done)
                    if self.stopping:
                        self.stopped = done
                        break
                if pending is not None:
                    record, pending = self._record(*pending), None
                    yield record
            finally:
                if pending is not None and self._attempted != pending[0]:
                    self._record(*pending)

    def _record(self, step: int, out: Any) -> tuple[int, dict[str, Any]]:
        self._attempted = step
        positions_B, data_metrics = self.drawn.pop(step)
        record, host = self.recorder.record(step, out, data_metrics)
        fetched = Fetched(host, positions_B)
        for hook in self.hooks:
            hook.on_record(self, step, record, fetched)
        return step, record

    def _batch_of(self, step: int) -> tuple[Any, ...]:
        """Step `step`'s device arguments, its draw noted for the curriculum."""
        batch, placed = self.started.batch(step)
        self.drawn[step] = (batch.all_positions_B, self.run.batches.metrics())
        return (*placed, jax.random.fold_in(self.started.key, step))
