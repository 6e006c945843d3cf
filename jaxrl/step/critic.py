"""PPO's advantages from a learned critic, inside the step: the values of the rollout's states,
then per-token GAE (Schulman et al. 2016; the equations are in `jaxrl.rl.gae`).

    values_BxC      = stop_gradient(critic(rollout))      one forward, by microbatches
    adv_BxC, G_BxC  = GAE(gamma, lambda) of the sequence reward at the last valid token
    adv_BxC         = whiten(adv_BxC) over the trained tokens     (algo.critic.whiten_advantages)

`apply_updates` then trains the policy on adv_BxC (PPO's clipped surrogate, `jaxrl.rl.losses`) and
the critic on the clipped value loss towards G_BxC from these values (V_old), both in the
same updates (`jaxrl.step.updates.microbatch_loss`): one loss, policy + vf_coef x value,
differentiated with respect to (policy, critic) and applied by their two optimizers
(`TrainState.apply_gradients`; the policy waits for the critic's warm-up).

Deliberate choices:
- The values are computed once, before the first update, from the critic as it was when the
  rollout was made (V_old); the advantages stay fixed over the step's updates, as in PPO.
- With a value head the values forward is a second forward of the policy's trunk (the old
  log-probs have their own, when the step makes several updates): sharing them would save
  a forward per step; not done yet.
- Explained variance is that of V_old against the returns G it produced: how much of the
  return the critic explained *before* this step's updates (cleanrl's and verl's choice).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config import AlgoSection
from jaxrl.rl.gae import explained_variance, gae_advantages, whiten
from jaxrl.step.forward import (
    UpdateBatch,
    completion_values,
    microbatching,
    split_rows,
    unsplit_rows,
)
from jaxrl.step.state import TrainState


def old_values(ts: TrainState, batch: UpdateBatch, num_micro: int, group: int,
               budgets: tuple[int, ...] = ()) -> jax.Array:
    """stop_gradient(values_BxC) of `ts`'s critic on `batch`, by `num_micro` microbatches
    (`budgets`: their packed shapes, `jaxrl.step.packing`)."""
    graphdef, state = nnx.split(ts)

    def one(mb):
        # A fresh copy per traced scope: nnx rejects Variables of another trace level.
        fresh = nnx.merge(graphdef, state, copy=True)
        return completion_values(fresh.critic, mb, fresh.model, group, budgets)

    parts = jax.lax.map(one, jax.tree.map(lambda x: split_rows(x, num_micro), batch))
    return jax.lax.stop_gradient(unsplit_rows(parts))


def gae_batch(cfg: AlgoSection, ts: TrainState, batch: UpdateBatch, group_size: int = 1,
              ) -> tuple[UpdateBatch, dict[str, jax.Array]]:
    """`batch` (`update_batch`, whose adv_B holds the sequence rewards: `phases.advantages`
    passes them through for gae) with per-token adv_BxC, returns_BxC and old_values_BxC in
    place of adv_B; and the metrics value/mean, value/explained_variance, value/returns_mean.
    """
    batch = dict(batch)
    rewards_B = batch.pop("adv_B")
    loss_mask_BxC = batch["loss_mask_BxC"]
    c = loss_mask_BxC.shape[1]
    completion_mask_BxC = batch["mask_BxT"][:, -c:]
    total_micro, group, budgets = microbatching(cfg, ts.model.config, group_size, batch)
    values_BxC = old_values(ts, batch, total_micro, group, budgets)
    adv_BxC, returns_BxC = gae_advantages(rewards_B, values_BxC, completion_mask_BxC,
                                          cfg.critic.gamma, cfg.critic.lam)
    if cfg.critic.whiten_advantages:
        adv_BxC = whiten(adv_BxC, loss_mask_BxC)
    valid_BxC = completion_mask_BxC.astype(bool)
    n = jnp.maximum(jnp.sum(valid_BxC), 1).astype(jnp.float32)
    metrics = {
        "value/mean": jnp.sum(jnp.where(valid_BxC, values_BxC, 0.0)) / n,
        "value/returns_mean": jnp.sum(returns_BxC) / n,
        "value/explained_variance": explained_variance(values_BxC, returns_BxC, valid_BxC),
    }
    batch.update(adv_BxC=adv_BxC, returns_BxC=returns_BxC,
                 old_values_BxC=jnp.where(valid_BxC, values_BxC, 0.0))
    return batch, metrics
