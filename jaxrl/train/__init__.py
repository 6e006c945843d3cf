"""Training: the optimizer, the sharded train state (and, later, the step builder and loop)."""

from jaxrl.train.optimizer import (
    OptimConfig,
    learning_rate_schedule,
    make_optimizer,
    weight_decay_mask,
)
from jaxrl.train.state import TrainState, create_train_state, reference_params

__all__ = [
    "OptimConfig", "TrainState", "create_train_state", "learning_rate_schedule",
    "make_optimizer", "reference_params", "weight_decay_mask",
]
