"""PPO's critic math: per-token generalised advantage estimation (GAE) and the clipped value
loss (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation"; Schulman et al. 2017, "Proximal Policy Optimization Algorithms").

A completion of sequence i is an episode whose steps are its valid tokens t = 0 .. |y_i| - 1
(mask m_it = 1); V_it is the critic's value of the state before token t (the prefix up to t).
The verifier's sequence reward R_i is paid at the last valid token, every other token earns 0:

    r_it     = R_i · [t = last valid token of i]
    delta_it = r_it + gamma · V_i,t+1 - V_it              V after the last valid token = 0
    A_it     = delta_it + gamma · lambda · A_i,t+1         A after the last valid token = 0
    G_it     = A_it + V_it                                  the critic's regression target

computed by a reverse `lax.scan` over the completion columns. Masked columns (padding after
the completion) are skipped: they carry neither reward nor value and reset nothing, so a
column after the end contributes exactly 0 (A = G = 0 there). Optionally the advantages are
whitened over the valid tokens of the batch, A <- (A - mean) / (std + eps), as PPO
implementations do (the returns keep the raw advantages).

The clipped value loss per valid token, with V_old the critic's values when the rollout was
scored (the values the advantages were computed from):

    V_clip = V_old + clip(V - V_old, -eps_v, +eps_v)
    l_it   = 1/2 · max((V - G)^2, (V_clip - G)^2)           (eps_v None: 1/2 · (V - G)^2)

aggregated over the valid tokens like the policy term (`jaxrl.rl.losses`: token_mean,
seq_mean_token_mean, seq_mean_token_sum_norm) with the same whole-minibatch counts, so
microbatch losses sum to the minibatch's.

Explained variance, the critic's fit: EV = 1 - Var(G - V) / Var(G) over the valid tokens
(1: perfect, 0: no better than a constant, < 0: worse; 0 when the returns are constant).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.rl.loss_config import Aggregation
from jaxrl.rl.losses import aggregate_tokens, token_counts


def gae_advantages(rewards_B: jax.Array, values_BxC: jax.Array, mask_BxC: jax.Array,
                   gamma: float, lam: float) -> tuple[jax.Array, jax.Array]:
    """(adv_BxC, returns_BxC) by GAE(gamma, lambda), the sequence reward at the last valid
    token; 0 at masked tokens (module docstring)."""
    valid_BxC = mask_BxC.astype(bool)
    values_BxC = jnp.where(valid_BxC, values_BxC.astype(jnp.float32), 0.0)
    c = valid_BxC.shape[1]
    # The last valid column of each row: the one after which no valid token follows.
    later_valid_BxC = jnp.flip(jnp.cumsum(jnp.flip(valid_BxC, 1), axis=1), 1) - valid_BxC
    last_BxC = valid_BxC & (later_valid_BxC == 0)
    reward_BxC = jnp.where(last_BxC, rewards_B.astype(jnp.float32)[:, None], 0.0)

    def back(carry, col):
        next_value_B, next_adv_B = carry
        reward_B, value_B, valid_B = col
        delta_B = reward_B + gamma * next_value_B - value_B
        adv_B = delta_B + gamma * lam * next_adv_B
        # A masked column passes the carry of the next valid token through unchanged.
        carry = (jnp.where(valid_B, value_B, next_value_B), jnp.where(valid_B, adv_B, next_adv_B))
        return carry, jnp.where(valid_B, adv_B, 0.0)

    zeros_B = jnp.zeros(valid_BxC.shape[:1], jnp.float32)
    _, adv_CxB = jax.lax.scan(back, (zeros_B, zeros_B),
                              (reward_BxC.T, values_BxC.T, valid_BxC.T), length=c,
                              reverse=True)
    adv_BxC = adv_CxB.T
    return adv_BxC, jnp.where(valid_BxC, adv_BxC + values_BxC, 0.0)


def whiten(x_BxC: jax.Array, mask_BxC: jax.Array, eps: float = 1e-8) -> jax.Array:
    """(x - mean) / (std + eps) over the valid tokens (population std); 0 at masked ones."""
    valid_BxC = mask_BxC.astype(bool)
    n = jnp.maximum(jnp.sum(valid_BxC), 1).astype(jnp.float32)
    x_BxC = jnp.where(valid_BxC, x_BxC.astype(jnp.float32), 0.0)
    mean = jnp.sum(x_BxC) / n
    var = jnp.sum(jnp.where(valid_BxC, jnp.square(x_BxC - mean), 0.0)) / n
    return jnp.where(valid_BxC, (x_BxC - mean) / (jnp.sqrt(var) + eps), 0.0)


def explained_variance(values_BxC: jax.Array, returns_BxC: jax.Array,
                       mask_BxC: jax.Array) -> jax.Array:
    """1 - Var(G - V) / Var(G) over the valid tokens; 0 when Var(G) = 0."""
    valid_BxC = mask_BxC.astype(bool)
    n = jnp.maximum(jnp.sum(valid_BxC), 1).astype(jnp.float32)

    def var(x_BxC):
        x_BxC = jnp.where(valid_BxC, x_BxC.astype(jnp.float32), 0.0)
        mean = jnp.sum(x_BxC) / n
        return jnp.sum(jnp.where(valid_BxC, jnp.square(x_BxC - mean), 0.0)) / n

    var_returns = var(returns_BxC)
    residual = var(returns_BxC.astype(jnp.float32) - values_BxC.astype(jnp.float32))
    return jnp.where(var_returns > 0, 1.0 - residual / jnp.where(var_returns > 0, var_returns,
                                                                 1.0), 0.0)


def value_loss(values_BxC: jax.Array, old_values_BxC: jax.Array, returns_BxC: jax.Array,
               mask_BxC: jax.Array, clip: float | None, aggregation: Aggregation, *,
               max_completion_len: int | None = None, num_tokens: jax.Array | None = None,
               num_seqs: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of the clipped value loss (module docstring); `num_tokens`, `num_seqs`
    as in `policy_loss` (None: this call's own counts).

    Metrics: `value/loss` (the loss), `value/clip_frac` (valid tokens whose clipped branch is
    the larger, so carries the gradient: 0 without clipping)."""
    valid_BxT, count_B, num_tokens, num_seqs = token_counts(mask_BxC, num_tokens, num_seqs)

    def masked(x):
        return jnp.where(valid_BxT, x.astype(jnp.float32), 0.0)

    values, old, target = masked(values_BxC), masked(old_values_BxC), masked(returns_BxC)
    unclipped = jnp.square(values - target)
    if clip is None:
        per_token, clipped_larger = unclipped, jnp.zeros_like(valid_BxT)
    else:
        clipped = jnp.square(old + jnp.clip(values - old, -clip, clip) - target)
        per_token, clipped_larger = jnp.maximum(unclipped, clipped), clipped > unclipped
    per_token = masked(0.5 * per_token)
    if aggregation == "seq_mean_token_sum_norm" and max_completion_len is None:
        raise ValueError("aggregation='seq_mean_token_sum_norm' divides by a constant: "
                         "pass max_completion_len")
    loss = aggregate_tokens(per_token, aggregation, count_B, num_tokens, num_seqs,
                            max_completion_len)
    return loss, {"value/loss": loss,
                  "value/clip_frac": jnp.sum(masked(clipped_larger)) / num_tokens}
