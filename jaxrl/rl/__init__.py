"""Pure RL math: per-token log-probs and entropies (also chunked over the vocabulary, from
hidden states), group-relative advantages (GRPO, RLOO, Dr. GRPO) and zero-variance groups, PPO's
per-token GAE and clipped value loss (a learned critic), the
clipped policy loss of the GRPO family (DAPO clip-higher, GSPO sequence ratios, Dr. GRPO
and LUSPO aggregation, KL to a reference, entropy bonus, truncated importance sampling) and
its variants (CISPO, SAPO, VESPO, dual clip, off-policy and top-entropy masks), DAPO's
overlong reward shaping, and the rewards API (in-graph JAX rewards and host Python rewards,
weighted and logged; text decoding is injected). Every function is pure and jittable (a
RewardSet's Python rewards run through a host callback), takes and returns arrays with their
shapes in their names, and states its equation in its docstring; nothing here imports any
other part of jaxrl.
"""

from jaxrl.rl.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
    zero_std_frac,
    zero_std_groups,
)
from jaxrl.rl.gae import explained_variance, gae_advantages, value_loss, whiten
from jaxrl.rl.logprobs import chunked_log_probs_and_entropy, token_entropy, token_log_probs
from jaxrl.rl.losses import PolicyLossConfig, kl_estimate, policy_loss
from jaxrl.rl.rewards import JaxReward, PythonReward, RewardInputs, RewardSet
from jaxrl.rl.shaping import overlong_penalty

__all__ = [
    "JaxReward", "PolicyLossConfig", "PythonReward", "RewardInputs", "RewardSet",
    "chunked_log_probs_and_entropy", "dr_grpo_advantages", "explained_variance",
    "gae_advantages", "grpo_advantages", "kl_estimate", "overlong_penalty", "policy_loss",
    "rloo_advantages",
    "token_entropy", "token_log_probs", "value_loss", "whiten", "zero_std_frac",
    "zero_std_groups",
]
