"""The compiled RL step: the step (`builder`), its rollout sources (`sources`, `asynchronous`,
`multiturn`), the learner and its updates, optimizer, sharded train state, phase functions,
phase clock and FLOP accounting. It imports nothing from `jaxrl.run`."""

from jaxrl.step.builder import Step, StepOutput, build_step
from jaxrl.step.optimizer import learning_rate_schedule, make_optimizer, weight_decay_mask
from jaxrl.step.sources import InGraph, Jitted, RolloutSource
from jaxrl.step.state import TrainState, create_train_state, reference_params

__all__ = [
    "InGraph", "Jitted", "RolloutSource", "Step", "StepOutput", "TrainState", "build_step",
    "create_train_state",
    "learning_rate_schedule", "make_optimizer", "reference_params", "weight_decay_mask",
]
