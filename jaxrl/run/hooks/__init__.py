"""The periodic work of a training run, one hook per module (`jaxrl.run.trainer.Hook`):

    preemption   SIGTERM / Ctrl-C: stop after the step in flight (checkpointed)
    curriculum   the prompt sampler observes each step's successes
    progress     the progress bar and the periodic progress lines
    guards       the reward-failure and non-finite guards: stop a failing run
    checkpoint   every train.checkpoint_every steps, at the end and on a stop
    evaluation   every eval.every steps (not at the last: the run's end evaluates)

`train_hooks` lists them in the order they run. `jaxrl bench` runs the curriculum with its own:

    timing       each step waited for and timed on the host; the measured steps' records
    profiling    a jax.profiler trace of the measured steps
"""

from __future__ import annotations

from rich.console import Console

from jaxrl.config import ExperimentConfig
from jaxrl.run.hooks.checkpoint import CheckpointHook
from jaxrl.run.hooks.curriculum import CurriculumHook
from jaxrl.run.hooks.evaluation import EvaluationHook
from jaxrl.run.hooks.guards import (
    NonFiniteError,
    NonFiniteGuard,
    RewardFailureError,
    RewardGuard,
    TrainingStopped,
)
from jaxrl.run.hooks.preemption import PreemptionHook
from jaxrl.run.hooks.progress import ProgressHook
from jaxrl.run.preemption import StopRequest
from jaxrl.run.start import Started
from jaxrl.run.trainer import Hook

__all__ = ["NonFiniteError", "RewardFailureError", "TrainingStopped", "train_hooks"]


def train_hooks(cfg: ExperimentConfig, started: Started, stop: StopRequest,
                console: Console) -> list[Hook]:
    """`jaxrl train`'s hooks, in order: a stop is known before the checkpoint decides, and
    a record is observed by the curriculum before the guards may end the run."""
    return [PreemptionHook(stop, started.run.queue),
            CurriculumHook(),
            ProgressHook(console, cfg.train.max_steps, started.start_step, cfg.log.print_every),
            RewardGuard(cfg.train, started.run.rows),
            NonFiniteGuard(cfg.train.max_skipped_in_a_row),
            CheckpointHook(started.checkpoints, cfg.train.checkpoint_every, cfg.train.max_steps),
            EvaluationHook(cfg.eval, cfg.train.max_steps)]
