"""Group-relative advantages: GRPO, RLOO and Dr. GRPO, and the zero-variance groups.

A batch holds P prompts with G completions each, prompt-major: row p·G + g is completion g
of prompt p, so `rewards_B.reshape(P, G)` puts each group on a row. With r_i the reward of
completion i and mean, std over its group:

    GRPO      A_i = (r_i - mean) / (std + eps)       std over the group ("group"), over the
                                                      whole batch ("batch"), or 1 ("none")
    RLOO      A_i = r_i - (sum_{j != i} r_j) / (G - 1) = G / (G - 1) · (r_i - mean)
    Dr. GRPO  A_i = r_i - mean                        (no std scaling: dividing by the std
                                                      up-weights near-unanimous groups)

std is the *sample* standard deviation (ddof = 1, Bessel-corrected), as `torch.std` in TRL,
so jaxrl's GRPO advantages equal TRL's for the same rewards: group [1, 0, 0, 1] has std
0.5774 (population std would be 0.5) and advantages ±0.866. eps = 1e-4 as in TRL. The
"batch" scale is TRL's too: the sample std of the raw rewards over the whole batch (not of
the group-centred rewards), as in "Tricks or Traps" (Lite PPO): group mean, batch std.

A group whose rewards are all equal has zero advantage under every estimator: its
completions carry no learning signal but still count in a token-mean loss. `zero_std_groups`
marks their rows so the trainer masks them out of the loss (the equivalent of DAPO's dynamic
sampling filter, without re-sampling), and `zero_std_frac` is the logged fraction
(`rollout/zero_std_frac`). Equality is tested exactly (max == min), not as std < tol: the
float mean of identical rewards need not equal them, so a computed std can be ~1e-8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.rl.settings import ScaleRewards, check_group_size


def _groups(rewards_B: jax.Array, group_size: int) -> jax.Array:
    """rewards [P·G] -> [P, G] in float32; checks that the batch splits into groups of >= 2."""
    check_group_size(group_size)
    if rewards_B.shape[0] % group_size:
        raise ValueError(f"batch of {rewards_B.shape[0]} rewards does not split into groups of "
                         f"group_size={group_size}")
    return rewards_B.astype(jnp.float32).reshape(-1, group_size)


def grpo_advantages(rewards_B: jax.Array, group_size: int,
                    scale_rewards: ScaleRewards = "group", eps: float = 1e-4) -> jax.Array:
    """A_i = (r_i - mean_group) / (std + eps), std = sample std of the group, batch, or 1."""
    r_PxG = _groups(rewards_B, group_size)
    centred_PxG = r_PxG - jnp.mean(r_PxG, axis=1, keepdims=True)
    if scale_rewards == "group":
        centred_PxG = centred_PxG / (jnp.std(r_PxG, axis=1, ddof=1, keepdims=True) + eps)
    elif scale_rewards == "batch":
        centred_PxG = centred_PxG / (jnp.std(r_PxG, ddof=1) + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be one of 'group', 'batch', 'none', "
                         f"got {scale_rewards!r}")
    return centred_PxG.reshape(-1)


def rloo_advantages(rewards_B: jax.Array, group_size: int) -> jax.Array:
    """A_i = r_i - (sum_{j != i} r_j) / (G - 1): the leave-one-out baseline."""
    r_PxG = _groups(rewards_B, group_size)
    others_PxG = (jnp.sum(r_PxG, axis=1, keepdims=True) - r_PxG) / (group_size - 1)
    return (r_PxG - others_PxG).reshape(-1)


def dr_grpo_advantages(rewards_B: jax.Array, group_size: int) -> jax.Array:
    """A_i = r_i - mean_group: GRPO without the std division (Dr. GRPO)."""
    r_PxG = _groups(rewards_B, group_size)
    return (r_PxG - jnp.mean(r_PxG, axis=1, keepdims=True)).reshape(-1)


def zero_std_groups(rewards_B: jax.Array, group_size: int) -> jax.Array:
    """mask_B: True on the rows whose group's rewards are all equal (no signal: mask them)."""
    r_PxG = _groups(rewards_B, group_size)
    flat_P = jnp.max(r_PxG, axis=1) == jnp.min(r_PxG, axis=1)
    return jnp.repeat(flat_P, group_size)


def zero_std_frac(rewards_B: jax.Array, group_size: int) -> jax.Array:
    """Fraction of groups whose rewards are all equal (metric `rollout/zero_std_frac`)."""
    r_PxG = _groups(rewards_B, group_size)
    return jnp.mean(jnp.max(r_PxG, axis=1) == jnp.min(r_PxG, axis=1), dtype=jnp.float32)
