"""Mixture of experts (Qwen3-MoE): a top-k softmax router over X SwiGLU experts, dispatched
with `jax.lax.ragged_dot`, and the router's load-balancing statistics.

Router, as transformers' `Qwen3MoeTopKRouter` (probabilities in float32):

    p_t = softmax(x_t @ W_router)                  [X] per token t
    (w_t, e_t) = top_k(p_t)                        k weights and expert ids
    w_t <- w_t / sum(w_t)                          only with `norm_topk_prob`
    y_t = sum_j w_tj · down_{e_tj}(silu(x_t @ gate_{e_tj}) * (x_t @ up_{e_tj}))

Dispatch: the N·k (token, expert) assignments are sorted by expert (a stable sort, so
equal experts keep token order), the tokens gathered in that order, and each expert's
contiguous group multiplied by its own weights with one `ragged_dot` per projection (group
sizes = tokens per expert); the outputs are put back in assignment order and summed with
their router weights, an einsum over k (no scatter-add, so the order of the sums does not
depend on the routing). Only the routed experts' FLOPs are spent on TPU/GPU, where XLA
lowers ragged_dot to grouped matmuls: 2·k·3·E·F per token. XLA:CPU lowers it to a masked
dense dot over all X experts (X/k times the work, and its cost analysis counts that): the
FLOP accounting compiles `gather_dispatch` instead (`ModelConfig.moe_dispatch`).
tokamax.ragged_dot is not used: on CPU it falls back to the same XLA op (benchmarks/README.md
has the comparison); its Pallas kernels are for GPU/TPU, where it is still to be measured.

Deliberate deviation: the router logits are accumulated in float32 (`preferred_element_type`)
for every compute dtype, where transformers takes them in the model's dtype before its
float32 softmax. In float32 the two are the same; in bf16 ours is the more precise, and the
sampler and the trainer run this same code, so their routing agrees.

Load balancing (Switch Transformer; transformers' `load_balancing_loss_func`, which
concatenates all layers' tokens before averaging): over L layers and the N real tokens,

    aux = X · sum_e f_e · P_e,   f_e = C_e / (L·N),   P_e = S_e / (L·N)

where C_e counts the (layer, token, slot) assignments to expert e and S_e sums its router
probability over layers and tokens. A layer contributes the pair (C, S) (`router_stats`);
they add over layers, and the loss is taken from the sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.dense import dense
from jaxrl.models.layers import normal, param
from jaxrl.sharding import constrain


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts: router [E, X], gate_up [X, E, 2, F], down [X, F, E]."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        e, f, x = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.router = param(normal(rngs, (e, x), config), ("embed", None))
        self.gate_up = param(normal(rngs, (x, e, 2, f), config),
                             ("expert", "embed", "gate_up", "mlp"))
        self.down = param(normal(rngs, (x, f, e), config), ("expert", "mlp", "embed"))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.dtype = config.compute_dtype
        self.dispatch = dispatch if config.moe_dispatch == "ragged_dot" else gather_dispatch

    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        return self.with_stats(x_BxTxE, None)[0]

    def route(self, x_NxE: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(weights_NxK in the compute dtype, experts_NxK, probs_NxX float32) of N tokens."""
        logits_NxX = dense(x_NxE, self.router[...].astype(self.dtype), "ne,ex->nx", jnp.float32)
        probs_NxX = jax.nn.softmax(logits_NxX, axis=-1)
        weights_NxK, experts_NxK = jax.lax.top_k(probs_NxX, self.top_k)
        if self.norm_topk_prob:
            weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
        return weights_NxK.astype(self.dtype), experts_NxK, probs_NxX

    def with_stats(self, x_BxTxE: jax.Array, valid_BxT: jax.Array | None,
                   ) -> tuple[jax.Array, jax.Array | None]:
        """(y_BxTxE, router_stats_2xX of the tokens where `valid_BxT` > 0, or None without
        it); `valid_BxT` may weight tokens (a shared prompt counts for its G rows)."""
        b, t, e = x_BxTxE.shape
        dt = self.dtype
        x_NxE = x_BxTxE.reshape(b * t, e)
        weights_NxK, experts_NxK, probs_NxX = self.route(x_NxE)
        y_NxE = self.dispatch(x_NxE, weights_NxK, experts_NxK, self.gate_up[...].astype(dt),
                         self.down[...].astype(dt))
        y_BxTxE = constrain(y_NxE.reshape(b, t, e), ("batch", "seq", "act_embed"))
        if valid_BxT is None:
            return y_BxTxE, None
        return y_BxTxE, router_stats(probs_NxX, experts_NxK,
                                     valid_BxT.reshape(-1).astype(jnp.float32))


def dispatch(x_NxE: jax.Array, weights_NxK: jax.Array, experts_NxK: jax.Array,
             gate_up_XxEx2xF: jax.Array, down_XxFxE: jax.Array, *,
             ragged_dot=jax.lax.ragged_dot) -> jax.Array:
    """sum_j w_nj · expert_{e_nj}(x_n) by sorted assignments and `ragged_dot` (module doc;
    another implementation of `jax.lax.ragged_dot`'s signature may be passed: benchmarks)."""
    n, k = experts_NxK.shape
    num_experts, e, _, f = gate_up_XxEx2xF.shape
    experts_M = experts_NxK.reshape(n * k)
    order_M = jnp.argsort(experts_M, stable=True)  # assignment m = token m // k, slot m % k
    group_sizes_X = jnp.bincount(experts_M, length=num_experts).astype(jnp.int32)
    xs_MxE = x_NxE[order_M // k]
    gate_up_Mx2F = ragged_dot(xs_MxE, gate_up_XxEx2xF.reshape(num_experts, e, 2 * f),
                                      group_sizes_X)
    gate_MxF, up_MxF = gate_up_Mx2F[:, :f], gate_up_Mx2F[:, f:]
    out_MxE = ragged_dot(jax.nn.silu(gate_MxF) * up_MxF, down_XxFxE, group_sizes_X)
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(n * k, dtype=order_M.dtype))
    out_NxKxE = out_MxE[inverse_M].reshape(n, k, e)
    return jnp.einsum("nke,nk->ne", out_NxKxE, weights_NxK)


def gather_dispatch(x_NxE: jax.Array, weights_NxK: jax.Array, experts_NxK: jax.Array,
                    gate_up_XxEx2xF: jax.Array, down_XxFxE: jax.Array) -> jax.Array:
    """`dispatch` with each assignment's expert weights gathered: the same numbers, and an
    HLO whose dots are exactly the routed experts' (2·N·k·3·E·F FLOPs), for FLOP counting."""
    gate_up_NxKxEx2xF = gate_up_XxEx2xF[experts_NxK]
    gate_up_NxKx2xF = jnp.einsum("ne,nkecf->nkcf", x_NxE, gate_up_NxKxEx2xF)
    h_NxKxF = jax.nn.silu(gate_up_NxKx2xF[:, :, 0]) * gate_up_NxKx2xF[:, :, 1]
    out_NxKxE = jnp.einsum("nkf,nkfe->nke", h_NxKxF, down_XxFxE[experts_NxK])
    return jnp.einsum("nke,nk->ne", out_NxKxE, weights_NxK)


def router_stats(probs_NxX: jax.Array, experts_NxK: jax.Array, valid_N: jax.Array) -> jax.Array:
    """[C, S] (2 x X, float32) of one layer: C_e = sum_n valid_n · #{j: e_nj = e},
    S_e = sum_n valid_n · p_ne."""
    num_experts = probs_NxX.shape[-1]
    counts_X = jnp.zeros((num_experts,), jnp.float32).at[experts_NxK].add(
        jnp.broadcast_to(valid_N[:, None], experts_NxK.shape))
    return jnp.stack([jax.lax.stop_gradient(counts_X), valid_N @ probs_NxX])


def load_balancing_loss(stats_2xX: jax.Array, num_layers: int, num_tokens: jax.Array,
                        ) -> jax.Array:
    """aux = X · sum_e (C_e / (L·N)) · (S_e / (L·N)) from `router_stats` summed over the L
    layers, N = the (weighted) count of real tokens."""
    counts_X, probs_X = stats_2xX[0], stats_2xX[1]
    denom = (num_layers * jnp.maximum(num_tokens, 1.0)) ** 2
    return stats_2xX.shape[-1] * jnp.sum(counts_X * probs_X) / denom
