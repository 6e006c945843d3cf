"""The analytic FLOP count, against numbers worked out by hand."""

import pytest

from jaxrl.models import ModelConfig
from jaxrl.perf import analytic

# E=8, 2 heads x d=4 (1 kv head), F=16, V=10, 3 layers.
CONFIG = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                     num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4)


def test_layer_matmul_params_are_qkvo_and_the_three_mlp_matrices():
    # q 8x(2x4) + k 8x4 + v 8x4 + o (2x4)x8 = 64 + 32 + 32 + 64; mlp 3 x 8 x 16 = 384
    assert analytic.layer_matmul_params(CONFIG) == 192 + 384


def test_forward_flops_by_hand():
    rows, tokens, keys, projected = 2, 5, 7, 3
    dense = 2 * 3 * 576 * tokens  # 2 x layers x N_layer per token
    attention = 4 * 3 * 2 * 4 * keys * tokens  # q.k and p.v over 7 keys, 2 heads of 4
    vocab = 2 * 8 * 10 * projected
    assert analytic.forward_flops(CONFIG, rows, tokens, keys, projected) == rows * (
        dense + attention + vocab)


def test_phases_use_the_shapes_the_programs_compute():
    p, c = 6, 4
    slots = p + c - 1
    assert analytic.prefill_flops(CONFIG, 3, p, c) == analytic.forward_flops(CONFIG, 3, p, slots, 1)
    assert analytic.decode_step_flops(CONFIG, 12, p, c) == analytic.forward_flops(
        CONFIG, 12, 1, slots, 1)
    assert analytic.logprob_flops(CONFIG, 5, p, c) == analytic.forward_flops(
        CONFIG, 5, p + c, p + c, c)
    assert analytic.grad_flops(CONFIG, 5, p, c) == pytest.approx(
        3 * analytic.logprob_flops(CONFIG, 5, p, c))


def test_the_engines_phases_use_the_shapes_its_programs_compute():
    # Prefill into a cache of the prompt's own width; a decode iteration of 3 slots, its
    # attention for 8 slots (whole chunks) over 12 keys.
    assert analytic.engine_prefill_flops(CONFIG, 3, 6) == analytic.forward_flops(
        CONFIG, 3, 6, 6, 1)
    attention = 4 * 3 * 2 * 4 * 12 * 8
    assert analytic.paged_decode_flops(CONFIG, 3, 12, 8) == analytic.forward_flops(
        CONFIG, 3, 1, 0, 1) + attention


def test_a_mixture_of_experts_counts_the_routed_experts_and_the_router():
    moe = ModelConfig(model_type="qwen3_moe", vocab_size=10, hidden_size=8, intermediate_size=16,
                      num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4, qk_norm=True,
                      num_experts=6, num_experts_per_tok=2, moe_intermediate_size=5)
    # attention as above (192); 2 routed experts x 3 x 8 x 5 = 240; router 8 x 6 = 48
    assert analytic.layer_matmul_params(moe) == 192 + 240 + 48
