"""Preemption as a hook: after each step, whether a stop was asked for (`StopRequest`: SIGTERM,
Ctrl-C, or JAX's preemption sync point in a multi-process run); then the checkpoint hook
saves and the loop ends after this step."""

from __future__ import annotations

import jax

from jaxrl.run.preemption import StopRequest
from jaxrl.run.trainer import Hook, Trainer
from jaxrl.step.asynchronous import QueuedRollouts


class PreemptionHook(Hook):
    def __init__(self, stop: StopRequest, queue: QueuedRollouts | None):
        self.stop = stop
        if queue is not None and jax.process_count() == 1:
            # A stop also ends the fill of a queue of batches made ahead (async): with a large
            # algo.max_staleness that fill is most of the run's first step. (With several
            # processes each fills alike; their stop comes from JAX's agreement, after a step.)
            queue.stop_requested = lambda: stop.signal is not None

    def due(self, trainer: Trainer, done: int) -> bool:
        return True  # `requested` is asked once per step, in order

    def after_step(self, trainer: Trainer, done: int) -> None:
        trainer.stopping = trainer.stopping or self.stop.requested(done - 1)
