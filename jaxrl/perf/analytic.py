"""The analytic FLOP count of the phase programs: the cross-check of XLA's cost analysis.

Counting matmuls only (2 FLOPs per multiply-add), for a decoder with L layers, hidden E,
n query / k kv heads of size d, MLP width F and vocabulary V:

    N_layer   = E·d·(2n + 2k) + 3·E·F                 matmul weights of one layer
                (a mixture of X experts, k_e per token, of width F_e: 3·E·F becomes
                 k_e·3·E·F_e + E·X, the routed experts and the router: active weights only)
    forward   = 2·L·N_layer per token                  (the "2·N per token")
              + 4·L·n·d·S per token                    attention: q·kᵀ and p·v over S keys
              + 2·E·V per projected position           the vocabulary projection
    backward  = 2 x forward                            (grads of activations and weights)

so a trained token costs 6·N + attention (the "6·N per trained token"). The counts follow
what the programs compute, padding included: training attends over the whole row of
T = P + C tokens (a masked square), or, with the prompt shared by a group, each prompt once
(a P x P square) and each row's C tokens over P + C keys, and projects only the C completion
positions onto the vocabulary; prefill writes P prompt tokens into a cache of S = P + C - 1
slots and attends over all of them; a decode step attends one token over the whole cache
(the engine: its prefill attends over the prompt's own width, and its decode iteration each
slot over its whole page table). Norms, RoPE,
softmax, SwiGLU gates and the optimizer update are elementwise and not counted here, which
is why XLA's count is a few percent higher on small models.
"""

from __future__ import annotations

from jaxrl.models import ModelConfig


def layer_matmul_params(config: ModelConfig) -> int:
    """N_layer: the weights of one decoder layer that take part in a token's matmuls."""
    e, d = config.hidden_size, config.head_dim
    attention = e * d * (2 * config.num_heads + 2 * config.num_kv_heads)
    return attention + config.mlp_params(active=True)


def forward_flops(config: ModelConfig, rows: int, tokens: int, keys: int,
                  projected: int) -> float:
    """Forward FLOPs of `rows` x `tokens` new tokens attending over `keys` keys each, with
    `projected` positions per row projected onto the vocabulary."""
    layers = config.num_layers
    dense = 2 * layers * layer_matmul_params(config) * tokens
    attention = 4 * layers * config.num_heads * config.head_dim * keys * tokens
    vocab = 2 * config.hidden_size * config.vocab_size * projected
    return float(rows * (dense + attention + vocab))


def prefill_flops(config: ModelConfig, prompts: int, prompt_len: int,
                  max_new_tokens: int) -> float:
    """One prefill of `prompts` rows of `prompt_len` tokens (last position projected)."""
    return forward_flops(config, prompts, prompt_len, prompt_len + max_new_tokens - 1, 1)


def decode_step_flops(config: ModelConfig, rows: int, prompt_len: int,
                      max_new_tokens: int) -> float:
    """One decode step: one token per row over the whole cache of P + C - 1 slots."""
    return forward_flops(config, rows, 1, prompt_len + max_new_tokens - 1, 1)


def engine_prefill_flops(config: ModelConfig, prompts: int, prompt_len: int) -> float:
    """The engine's prefill: `prompts` rows of `prompt_len` tokens into a cache of just
    their own width (last position projected)."""
    return forward_flops(config, prompts, prompt_len, prompt_len, 1)


def paged_decode_flops(config: ModelConfig, slots: int, keys: int, attended: int) -> float:
    """One decode iteration of the engine: one token per slot through the layers and the
    vocabulary, and the attention of `attended` slots (the slots, in whole chunks) over
    `keys` keys each (every block of the page table: pages x page size, in whole blocks)."""
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * keys * attended
    return forward_flops(config, slots, 1, 0, 1) + float(attention)


def logprob_flops(config: ModelConfig, rows: int, prompt_len: int, completion_len: int,
                  prompt_group: int = 1) -> float:
    """Completion log-probs of `rows` sequences of P + C tokens (forward only); with
    `prompt_group` g > 1 each prompt runs once for g rows (a masked P x P square) and the
    rows' C tokens attend over P + C keys."""
    seq = prompt_len + completion_len
    if prompt_group == 1:
        return forward_flops(config, rows, seq, seq, completion_len)
    return (forward_flops(config, rows // prompt_group, prompt_len, prompt_len, 0)
            + forward_flops(config, rows, completion_len, seq, completion_len))


def grad_flops(config: ModelConfig, rows: int, prompt_len: int, completion_len: int,
               prompt_group: int = 1) -> float:
    """Loss and gradients of `rows` sequences: forward + backward = 3 x forward."""
    return 3 * logprob_flops(config, rows, prompt_len, completion_len, prompt_group)
