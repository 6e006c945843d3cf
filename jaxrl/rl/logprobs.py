"""Per-token log-probabilities and entropies of a policy, from logits or from hidden states.

With logits l = logits / T over a vocabulary of V tokens:

    lse      = log sum_v exp(l_v)
    logp     = l_target - lse                        = log_softmax(l)[target]
    H        = -sum_v p_v log p_v = lse - E_p[l]     with p = softmax(l)

`token_log_probs` and `token_entropy` take logits [B, T, V]. At RL scale (B·T ~ 10^5-10^6
tokens, V ~ 1.5·10^5) those logits do not fit in memory, so `chunked_log_probs_and_entropy`
computes both from the final hidden states and the output projection, V in chunks of C
columns, with the online (streaming) softmax of flash attention:

    for each chunk c:   l_c = (h @ w[:, c]) / T                   [B, T, C], float32 accumulate
        m'  = max(m, max_v l_c)
        s   = s · exp(m - m') + sum_v exp(l_c - m')               running sum-exp
        a   = a · exp(m - m') + sum_v exp(l_c - m') · l_c          running sum of exp(l - m)·l
        tgt = tgt + l_c[target]  (the target lies in one chunk)
        m   = m'
    lse = m + log s ;  logp = tgt - lse ;  H = lse - a / s

V is padded to a multiple of C with zero columns whose logits are set to -inf, so they add
nothing to s or a. The scan body is rematerialised (`jax.checkpoint`): the backward pass
recomputes each chunk's logits instead of storing them, so neither direction holds more than
one [B, T, C] chunk; the running max m is a constant for differentiation (lse and a/s do not
depend on it), as in `jax.nn.logsumexp`. Peak memory is O(B·T·C + E·V) instead of O(B·T·V).

All outputs are float32 whatever the input dtype: the matmul runs in the inputs' dtype
(bf16 on accelerators) and accumulates in float32 (`preferred_element_type`), and the
softmax statistics are float32, so chunked and unchunked results agree to float32 rounding.

No fused kernel replaces this path: tokamax 0.0.12's `linear_softmax_cross_entropy_loss(x
[N, H], labels [N], weights [H, V], *, reduction: "sum" | "mean") -> scalar` returns only the
reduced loss (its per-token log-sum-exp stays a private residual, its backward takes a scalar
cotangent; no entropy, no temperature), while the policy loss weights each token's log-prob
and entropy; its implementations are an XLA reference that holds the [N, V] logits (the one
that runs on CPU and GPU) and a Pallas Mosaic kernel for TPU v5+ (`benchmarks/logprobs.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_log_probs(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                    temperature: float = 1.0) -> jax.Array:
    """logp[b, t] = log_softmax(logits[b, t] / T)[targets[b, t]], in float32."""
    logits_BxTxV = logits_BxTxV.astype(jnp.float32) / temperature
    lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    return target_BxT - lse_BxT


def token_entropy(logits_BxTxV: jax.Array, temperature: float = 1.0) -> jax.Array:
    """H[b, t] = -sum_v p_v log p_v = lse - sum_v p_v l_v with p = softmax(l), l = logits / T."""
    logits_BxTxV = logits_BxTxV.astype(jnp.float32) / temperature
    lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    probs_BxTxV = jnp.exp(logits_BxTxV - lse_BxT[..., None])
    # A -inf logit (a token masked out) has p = 0; p · l would be 0 · -inf = NaN. Raised to
    # the lowest float instead, p · l is 0 there: an elementwise max, which XLA:CPU fuses into
    # the sum (a select on isfinite would be written out as a [B, T, V] array of its own).
    floor = jnp.finfo(jnp.float32).min
    return lse_BxT - jnp.sum(probs_BxTxV * jnp.maximum(logits_BxTxV, floor), axis=-1)


def chunked_log_probs_and_entropy(hidden_BxTxE: jax.Array, w_ExV: jax.Array,
                                  targets_BxT: jax.Array, *, temperature: float = 1.0,
                                  chunk_size: int = 8192, unroll: bool = False,
                                  ) -> tuple[jax.Array, jax.Array]:
    """(logp_BxT, entropy_BxT) of logits = hidden @ w / T, never materialising [B, T, V].

    Equal to `token_log_probs` and `token_entropy` of `hidden @ w` (see the module docstring
    for the online softmax); `chunk_size` trades peak memory (B·T·chunk_size floats) against
    the number of scan steps, and need not divide V. `unroll` unrolls the scan (same
    numbers; for FLOP accounting, since XLA's cost analysis counts a loop body once).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    vocab = w_ExV.shape[1]
    chunk_size = min(chunk_size, vocab)
    num_chunks = -(-vocab // chunk_size)
    padded = num_chunks * chunk_size
    if padded != vocab:
        w_ExV = jnp.pad(w_ExV, ((0, 0), (0, padded - vocab)))
    batch_shape = targets_BxT.shape

    @jax.checkpoint
    def step(carry, start):
        m_BxT, s_BxT, a_BxT, tgt_BxT = carry
        w_ExC = jax.lax.dynamic_slice_in_dim(w_ExV, start, chunk_size, axis=1)
        logits_BxTxC = jnp.einsum("bte,ec->btc", hidden_BxTxE, w_ExC,
                                  preferred_element_type=jnp.float32) / temperature
        ids_C = start + jnp.arange(chunk_size)
        valid_C = ids_C < vocab
        logits_BxTxC = jnp.where(valid_C, logits_BxTxC, -jnp.inf)
        m_new_BxT = jax.lax.stop_gradient(jnp.maximum(m_BxT, jnp.max(logits_BxTxC, axis=-1)))
        rescale_BxT = jnp.exp(m_BxT - m_new_BxT)
        exp_BxTxC = jnp.exp(logits_BxTxC - m_new_BxT[..., None])
        # Padded columns have exp = 0 and logit -inf; 0 · -inf would be NaN.
        finite_BxTxC = jnp.where(valid_C, logits_BxTxC, 0.0)
        s_BxT = s_BxT * rescale_BxT + jnp.sum(exp_BxTxC, axis=-1)
        a_BxT = a_BxT * rescale_BxT + jnp.sum(exp_BxTxC * finite_BxTxC, axis=-1)
        is_target_BxTxC = ids_C == targets_BxT[..., None]
        tgt_BxT = tgt_BxT + jnp.sum(jnp.where(is_target_BxTxC, finite_BxTxC, 0.0), axis=-1)
        return (m_new_BxT, s_BxT, a_BxT, tgt_BxT), None

    zeros_BxT = jnp.zeros(batch_shape, jnp.float32)
    init = (jnp.full(batch_shape, -jnp.inf, jnp.float32), zeros_BxT, zeros_BxT, zeros_BxT)
    starts_N = jnp.arange(num_chunks, dtype=jnp.int32) * chunk_size
    (m_BxT, s_BxT, a_BxT, tgt_BxT), _ = jax.lax.scan(step, init, starts_N,
                                                     unroll=unroll or 1)
    lse_BxT = m_BxT + jnp.log(s_BxT)
    return tgt_BxT - lse_BxT, lse_BxT - a_BxT / s_BxT
