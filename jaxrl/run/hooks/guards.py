"""The guards that stop a failing run, from each step's record (its metrics are written
first; no checkpoint of the failing state is made):

- rewards: a step *fails its rewards* when some reward failed (raised, or returned a
  non-number or a value outside its bounds: `jaxrl.rl.rewards`) on more than
  `train.reward_error_frac` of the step's samples (reward/errors/<name> / (data.batch_size x
  rollout.num_generations)); after `train.reward_error_steps` such steps in a row the run
  stops with `RewardFailureError`, whose message holds that reward's first error (the count
  restarts on resume).
- non-finite: an update whose loss or gradient is not finite is skipped in the program
  (`apply_updates`); after `train.max_skipped_in_a_row` such steps in a row the run stops with
  `NonFiniteError`.
"""

from __future__ import annotations

from typing import Any

from jaxrl.config.run import TrainSection
from jaxrl.run.trainer import Fetched, Hook, Trainer


class TrainingStopped(RuntimeError):
    """The run stopped on a fault of the training itself (its metrics are written); the
    command exits with status 1 and this message."""


class NonFiniteError(TrainingStopped):
    """Too many steps in a row had a non-finite loss or gradient: the run stopped."""


class RewardFailureError(TrainingStopped):
    """A reward failed on too many samples for too many steps in a row: the run stopped."""


class RewardGuard(Hook):
    def __init__(self, train: TrainSection, rows: int):
        self.frac, self.steps, self.rows = train.reward_error_frac, train.reward_error_steps, rows
        self.failing = 0  # steps in a row that failed their rewards

    def on_record(self, trainer: Trainer, step: int, record: dict[str, Any],
                  fetched: Fetched) -> None:
        rewards = trainer.run.step.rewards
        rewards.observe(step, record)  # notes the first error of each JAX reward
        fraction, name = max((record.get(f"reward/errors/{r.name}", 0.0) / self.rows, r.name)
                             for r in rewards.rewards)
        self.failing = self.failing + 1 if fraction > self.frac else 0
        if self.failing >= self.steps:
            first = rewards.errors.get(name) or (f"reward {name!r} failed on the rows of "
                                                 f"another process: see its log")
            raise RewardFailureError(
                f"step {step}: reward {name!r} failed on {fraction:.0%} of the step's samples, "
                f"more than train.reward_error_frac={self.frac}, {self.failing} steps in a "
                f"row (train.reward_error_steps={self.steps}); its first error: {first}")


class NonFiniteGuard(Hook):
    def __init__(self, max_skipped_in_a_row: int):
        self.limit = max_skipped_in_a_row

    def on_record(self, trainer: Trainer, step: int, record: dict[str, Any],
                  fetched: Fetched) -> None:
        if record["train/skipped_in_a_row"] >= self.limit:
            raise NonFiniteError(
                f"step {step}: {int(record['train/skipped_in_a_row'])} steps in a row had a "
                f"non-finite loss or gradient (their updates were skipped; "
                f"train.max_skipped_in_a_row={self.limit}); lower optim.lr, keep "
                f"optim.max_grad_norm on, check the rewards for NaN, or resume from an "
                f"earlier checkpoint")
