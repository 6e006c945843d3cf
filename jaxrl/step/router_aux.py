"""The mixture-of-experts load-balancing term of the training loss (`algo.router_aux_coef`).

    loss = policy loss + c · sum_mb (n_mb / n) · aux_mb

aux_mb is the Switch load-balancing loss of one microbatch's forward (`jaxrl.models.moe`:
X · sum_e f_e · P_e over the layers and the rows' real tokens, prompt included, as
transformers counts them with an attention mask), and n_mb / n its share of the minibatch's
loss tokens, so that the gradient-accumulated sum over microbatches is their token-weighted
mean, whatever the microbatch size. Metric `loss/router_aux`: that mean, without c.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models import ModelConfig
from jaxrl.models.moe import load_balancing_loss


def uses_router_aux(coef: float, config: ModelConfig) -> bool:
    """Whether the training forward must return the router statistics."""
    return coef > 0 and config.num_experts > 0


def add_router_aux(coef: float, config: ModelConfig, stats_2xX: jax.Array,
                   mb: dict[str, jax.Array], num_tokens: jax.Array, loss: jax.Array,
                   metrics: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss + c · share · aux, metrics + loss/router_aux) of one microbatch `mb`."""
    aux = load_balancing_loss(stats_2xX, config.num_layers,
                              jnp.sum(mb["mask_BxT"], dtype=jnp.float32))
    share = jnp.sum(mb["loss_mask_BxC"], dtype=jnp.float32) / jnp.maximum(num_tokens, 1)
    return loss + coef * share * aux, {**metrics, "loss/router_aux": share * aux}
