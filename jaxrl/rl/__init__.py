"""Pure RL math: per-token log-probs and entropies (also chunked over the vocabulary, from
hidden states), group-relative advantages (GRPO, RLOO, Dr. GRPO) and zero-variance groups, the
clipped policy loss of the GRPO family (DAPO clip-higher, GSPO sequence ratios, Dr. GRPO
aggregation, KL to a reference, entropy bonus, truncated importance sampling) and DAPO's
overlong reward shaping. Every function is pure and jittable, takes and returns arrays with
their shapes in their names, and states its equation in its docstring; nothing here imports
any other part of jaxrl.
"""

from jaxrl.rl.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
    zero_std_frac,
    zero_std_groups,
)
from jaxrl.rl.logprobs import chunked_log_probs_and_entropy, token_entropy, token_log_probs
from jaxrl.rl.losses import PolicyLossConfig, kl_estimate, policy_loss
from jaxrl.rl.shaping import overlong_penalty

__all__ = [
    "PolicyLossConfig", "chunked_log_probs_and_entropy", "dr_grpo_advantages",
    "grpo_advantages", "kl_estimate", "overlong_penalty", "policy_loss", "rloo_advantages",
    "token_entropy", "token_log_probs", "zero_std_frac", "zero_std_groups",
]
