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
`layers` axis of `scan_layers` and the part axis of a fused projection (`qkv`, `gate_up`: HF
has one tensor per part) do not count, and `head_dim` is merged into `heads` / `kv_heads`
(jaxrl splits HF's fused [heads*head_dim] dimension), so the q/k/v bias [kv_heads, qkv,
head_dim] or a stacked norm scale [layers, embed] is a vector, as in HF. Arrays without logical axes
count their own dimensions.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from jaxrl.config import OptimSection
from jaxrl.sharding.rules import variable_axes

# Logical axes that do not make a parameter "more than a vector" (see the module docstring):
# stacked layers, and the parts of a fused projection (HF's separate q/k/v, gate/up tensors).
_STACKING_AXES = ("layers", "qkv", "gate_up")
_HEAD_AXES = ("heads", "kv_heads")


def learning_rate_schedule(cfg: OptimSection) -> optax.Schedule:
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


def make_optimizer(cfg: OptimSection, decay_mask: Any = None) -> optax.GradientTransformation:
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
