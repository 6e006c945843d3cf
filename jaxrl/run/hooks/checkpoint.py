"""Checkpoints as a hook: every `train.checkpoint_every` steps, after the last step, and on a
stop (preemption), with the step's record made first (a checkpoint holds the curriculum's
view of its step). Saving is asynchronous: the next step starts at once. An asynchronous
run (algo.mode=async) also saves the batches it made ahead (`jaxrl.run.async_queue`)."""

from __future__ import annotations

from jaxrl.run.async_queue import queue_checkpoint
from jaxrl.run.trainer import Hook, Trainer, every
from jaxrl.saved.checkpoint import Checkpoints


class CheckpointHook(Hook):
    needs_record = True

    def __init__(self, checkpoints: Checkpoints, every_n: int, max_steps: int):
        self.checkpoints, self.every, self.max_steps = checkpoints, every_n, max_steps

    def due(self, trainer: Trainer, done: int) -> bool:
        return trainer.stopping or (self.every > 0 and (every(self.every, done)
                                                        or done == self.max_steps))

    def after_step(self, trainer: Trainer, done: int) -> None:
        made_ahead = trainer.run.queue
        queue = None if made_ahead is None else queue_checkpoint(made_ahead, trainer.drawn)
        self.checkpoints.save(done, trainer.state, trainer.run.batches.state(),
                              trainer.started.key, queue=queue)
