"""Training: the optimizer, the sharded train state, the step builder, and the run loop
(`jaxrl.train.loop.train`, which `jaxrl train` calls)."""

from jaxrl.train.optimizer import (
    OptimConfig,
    learning_rate_schedule,
    make_optimizer,
    weight_decay_mask,
)
from jaxrl.train.state import TrainState, create_train_state, reference_params
from jaxrl.train.step import Step, StepConfig, build_step

__all__ = [
    "OptimConfig", "Step", "StepConfig", "TrainState", "build_step", "create_train_state", "learning_rate_schedule",
    "make_optimizer", "reference_params", "weight_decay_mask",
]
