"""The trainer: `run_steps()` runs the steps; the periodic work of a run, and all that is done
with a step's record, are hooks (`jaxrl.run.hooks`).

    trainer = Trainer(started, recorder, hooks, max_steps)
    trainer.run_steps()   each step dispatched; step N's record made after step N+1 was
                          dispatched (the host logs while the device works: nanodo's way)
                          and handed to every hook's `on_record`
    trainer.state, trainer.stopped, trainer.seconds               afterwards

Each step: every hook's `before_step`, dispatch step N (the step call returns at once; the
state is donated and carried; drawing its batch calls every hook's `on_draw`), every hook's
`on_dispatch`, make step N-1's record (fetching it waits for N-1 only), then, in the hooks'
order, every hook that is due after N+1 steps (`Hook.due`) runs `after_step`; one that reads
the run's state as of step N (`needs_record`: a checkpoint holds the curriculum's view of N,
an evaluation follows it in the log, bench's timer records every step at once) gets step
N's record made first. Every record goes through each hook's `on_record`, in order: records
flow only there. A hook that sets `trainer.stopping` (preemption) ends the loop after the
remaining hooks of that step ran. Step N-1's record is made even when step N failed or was
interrupted, but not again when making it was what failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jaxrl.data.prompts import PromptBatch
from jaxrl.run.recorder import StepRecorder
from jaxrl.run.start import Started


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A step's output as fetched to the host, and its batch's prompt positions."""

    out: Any  # jaxrl.step.StepOutput of numpy arrays
    positions_B: Any


class Hook:
    """Work of a run around its steps: periodic (`due`, `after_step`), per step (before its
    dispatch, at its draw, after its dispatch) and on each record. Subclasses override what
    they need; a hook may also be a context manager, entered around the whole loop (a
    progress display, a profiler trace)."""

    needs_record = False  # after_step needs the step's own record made first

    def before_step(self, trainer: Trainer, step: int) -> None:
        """Work just before step `step` is dispatched (a profiler trace starts here)."""

    def on_draw(self, trainer: Trainer, step: int, batch: PromptBatch) -> None:
        """Step `step`'s batch as drawn, on the host (an async run draws steps ahead)."""

    def on_dispatch(self, trainer: Trainer, step: int, out: Any) -> None:
        """Step `step` was dispatched; `out` its output on the device, not waited for (a
        hook that waits for it and times it may note the seconds in `trainer.step_s`)."""

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
        # A step's seconds as a hook measured them (bench: waited for on the host), its
        # record's time/step_s in place of the recorder's own measure.
        self.step_s: dict[int, float] = {}
        self._pending: tuple[int, Any] | None = None  # the step dispatched, not yet recorded

    @property
    def seconds(self) -> float:
        """Seconds since the first dispatch."""
        return time.perf_counter() - self.recorder.start

    def run_steps(self) -> None:
        """Steps from `started.start_step` to `max_steps` or a stop (module docstring); each
        record goes to the hooks' `on_record`."""
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                if isinstance(hook, contextlib.AbstractContextManager):
                    stack.enter_context(hook)
            try:
                for step in range(self.started.start_step, self.max_steps):
                    self._step(step)
                    if self.stopping:
                        self.stopped = step + 1
                        break
            finally:
                self._record_pending()  # the last step's (also when the next one failed)

    def _step(self, step: int) -> None:
        """Dispatches step `step`, records the one before, runs the hooks that are due."""
        for hook in self.hooks:
            hook.before_step(self, step)
        self.state, out = self.run.step(self.state, step, self._batch_of, self.run.ref_params)
        for hook in self.hooks:
            hook.on_dispatch(self, step, out)
        self._record_pending()
        self._pending, done = (step, out), step + 1
        for hook in self.hooks:
            if not hook.due(self, done):
                continue
            if hook.needs_record:
                self._record_pending()
            hook.after_step(self, done)

    def _record_pending(self) -> None:
        """Makes the pending step's record; it is no longer pending even if that fails."""
        if self._pending is not None:
            (step, out), self._pending = self._pending, None
            self._record(step, out)

    def _record(self, step: int, out: Any) -> None:
        positions_B, data_metrics = self.drawn.pop(step)
        record, host = self.recorder.record(step, out, data_metrics,
                                            step_s=self.step_s.pop(step, None))
        fetched = Fetched(host, positions_B)
        for hook in self.hooks:
            hook.on_record(self, step, record, fetched)

    def _batch_of(self, step: int) -> tuple[Any, ...]:
        """Step `step`'s device arguments, its draw noted for the curriculum."""
        batch, placed = self.started.batch(step)
        self.drawn[step] = (batch.all_positions_B, self.run.batches.metrics())
        for hook in self.hooks:
            hook.on_draw(self, step, batch)
        return (*placed, jax.random.fold_in(self.started.key, step))
