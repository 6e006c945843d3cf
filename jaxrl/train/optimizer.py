"""The optimizer: global-norm clipping, then AdamW on a warmup + cosine learning-rate schedule.

    g      <- g * min(1, max_grad_norm / ||g||_2)        (||.||_2 over all parameters at once)
    m, v   <- Adam moments of g (bias-corrected)
    update  = -lr_t * (m / (sqrt(v) + eps) + weight_decay * p * [p is a weight matrix])

    lr_t    = lr * t / warmup_steps                                  t < warmup_steps
            = lr * (r + (1 - r) * (1 + cos(pi * s)) / 2),            s = (t - warmup) / (total - warmup)
            = lr * r                                                 t >= total_steps
    (r = min_lr_ratio; with total_steps None the rate stays at lr after warmup)

Everything is optax's own (`clip_by_global_norm`, `adamw`, `linear_schedule`,
`cosine_decay_schedule`, `join_schedules`); t is optax's update count, so the first update uses
lr_0, which is 0 when there is a warmup (as in transformers' warmup schedules).

Weight decay is decoupled (AdamW) and applied to weight matrices only, through optax's
`mask`: norm scales and biases are not decayed. "Matrix" is judged on the parameter as a
Hugging Face checkpoint stores it, from its logical axes (`weight_decay_mask`): the stacked
`layers` axis of `scan_layers` does not count, and `head_dim` is merged into `heads` /
`kv_heads` (jaxrl splits HF's fused [heads*head_dim] dimension), so a q-bias [heads, head_dim]
or a stacked norm scale [layers, embed] is a vector, as in HF. Arrays without logical axes
count their own dimensions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax
from flax import nnx

from jaxrl.sharding.rules import variable_axes

# Logical axes that do not make a parameter "more than a vector" (see the module docstring).
_STACKING_AXES = ("layers",)
_HEAD_AXES = ("heads", "kv_heads")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The `optim` section of an experiment config."""

    lr: float = 1e-6  # peak learning rate
    warmup_steps: int = 0  # linear warmup from 0 to lr
    total_steps: int | None = None  # end of the cosine decay (counting warmup); None: constant
    min_lr_ratio: float = 0.0  # the cosine's floor, as a fraction of lr
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0  # decoupled; weight matrices only
    max_grad_norm: float | None = 1.0  # global-norm clipping; None: off

    def __post_init__(self):
        def fail(name: str, requirement: str):
            raise ValueError(f"optim.{name} must be {requirement}, got {getattr(self, name)!r}")

        for name in ("warmup_steps", "total_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                fail(name, "an integer")
        # `not x > 0` also rejects NaN.
        if not (self.lr > 0 and math.isfinite(self.lr)):
            fail("lr", "a finite number > 0")
        if self.warmup_steps < 0:
            fail("warmup_steps", ">= 0")
        if self.total_steps is not None and not self.total_steps > self.warmup_steps:
            fail("total_steps", f"None or > warmup_steps ({self.warmup_steps})")
        if not 0 <= self.min_lr_ratio <= 1:
            fail("min_lr_ratio", "in [0, 1]")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                fail(name, "in [0, 1)")
        if not self.eps > 0:
            fail("eps", "> 0")
        if not self.weight_decay >= 0:
            fail("weight_decay", ">= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            fail("max_grad_norm", "None or > 0")


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `min_lr_ratio * lr` at `total_steps`."""
    if cfg.total_steps is None:
        after_warmup = optax.constant_schedule(cfg.lr)
    else:
        after_warmup = optax.cosine_decay_schedule(
            cfg.lr, cfg.total_steps - cfg.warmup_steps, alpha=cfg.min_lr_ratio)
    if cfg.warmup_steps == 0:
        # optax's linear_schedule over 0 steps would be the constant 0 (and log a warning).
        return after_warmup
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), after_warmup], [cfg.warmup_steps])


def weight_decay_mask(params: Any) -> Any:
    """True for each parameter that weight decay applies to (a matrix), False for vectors.

    `params` holds nnx Variables (their logical axes decide, see the module docstring) or plain
    arrays (more than one dimension decides). The result has the structure of
    `nnx.as_pure(params)`: that of the gradients and updates the optimizer sees.
    """
    def is_matrix(leaf) -> bool:
        if not isinstance(leaf, nnx.Variable):
            return len(leaf.shape) > 1
        axes = [a for a in variable_axes(leaf) if a not in _STACKING_AXES]
        if any(a in _HEAD_AXES for a in axes):
            axes = [a for a in axes if a != "head_dim"]
        return len(axes) > 1

    return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimConfig, decay_mask: Any = None) -> optax.GradientTransformation:
    """`clip_by_global_norm` (unless `max_grad_norm` is None), then AdamW on the schedule.

    `decay_mask` is a pytree of bools with the structure of the gradients (from
    `weight_decay_mask` of the model's Params) or a callable returning one; by default every
    array with more than one dimension is decayed.
    """
    if decay_mask is None:
        decay_mask = weight_decay_mask
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
