"""Per-token sampling: temperature, top-k, top-p (nucleus) and greedy, with log-probs.

    processed = mask_topk_topp(logits / temperature)
    token     ~ softmax(processed)                 (argmax of logits when temperature == 0)
    logp      = log_softmax(processed)[token]      the distribution actually sampled from
    logp_raw  = log_softmax(logits)[token]         the model at temperature 1

Top-k keeps the tokens whose logit is at least the k-th largest; top-p keeps the smallest
prefix of the tokens sorted by probability whose mass reaches p (the most likely token is
always kept). Filtered tokens get -inf, so they can never be drawn. Greedy decoding samples
from a point mass: its `logp` is 0.

Vocabulary-wide work per decode step only where the settings need it: top-k runs only when
set, a sort of the vocabulary only for top-p without top-k (after top-k, top-p reads the k
values top-k returns sorted), and one log-softmax serves both log-probs when temperature 1
and no filter leave the logits as they are (`unchanged`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl.rollout.settings import SamplingParams
from jaxrl.sharding.rules import active_rules


def process_logits(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p; excluded tokens are set to -inf."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if params.greedy:
        return logits_BxV
    logits_BxV = logits_BxV / params.temperature
    sorted_BxK = None
    if params.top_k is not None and params.top_k < logits_BxV.shape[-1]:
        sorted_BxK = jax.lax.top_k(logits_BxV, params.top_k)[0]
        logits_BxV = jnp.where(logits_BxV >= sorted_BxK[:, -1:], logits_BxV, -jnp.inf)
    if params.top_p is not None and params.top_p < 1:
        if sorted_BxK is None:
            sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
            return _top_p_mask(logits_BxV, sorted_BxV, params.top_p, 0.0)
        # After top-k every kept logit is one of the k sorted ones or ties the k-th, so top-p
        # needs no sort of the vocabulary: the ties beyond k join the normaliser, and never
        # move the threshold (a kept tie means the k-th, of the same value, is kept).
        ties_B1 = jnp.sum(jnp.isfinite(logits_BxV), -1, keepdims=True) - params.top_k
        rest_B1 = ties_B1 * jnp.exp(sorted_BxK[:, -1:] - sorted_BxK[:, :1])
        return _top_p_mask(logits_BxV, sorted_BxK, params.top_p, rest_B1)
    return logits_BxV


def _top_p_mask(logits_BxV: jax.Array, sorted_BxN: jax.Array, p: float,
                rest_B1: jax.Array | float) -> jax.Array:
    """Top-p of `logits_BxV` from its N largest values, sorted descending; `rest_B1`: the sum
    of exp(l - max) over the kept logits beyond those N (their share of the normaliser)."""
    exp_BxN = jnp.exp(sorted_BxN - sorted_BxN[:, :1])
    probs_BxN = exp_BxN / (jnp.sum(exp_BxN, axis=-1, keepdims=True) + rest_B1)
    # Mass strictly before each sorted token; keep it while that mass is still < p.
    before_BxN = jnp.cumsum(probs_BxN, axis=-1) - probs_BxN
    threshold_B1 = jnp.min(jnp.where(before_BxN < p, sorted_BxN, jnp.inf), axis=-1,
                           keepdims=True)
    return jnp.where(logits_BxV >= threshold_B1, logits_BxV, -jnp.inf)


def sample_tokens(keys_B: jax.Array, logits_BxV: jax.Array,
                  params: SamplingParams) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token_B, logp_B, logp_raw_B); row b draws with its own key, so rows are independent."""
    processed_BxV = process_logits(logits_BxV, params)
    if params.greedy:
        token_B = jnp.argmax(processed_BxV, axis=-1)
    else:
        token_B = categorical(keys_B, processed_BxV)
    token_B = token_B.astype(jnp.int32)
    logp_raw_B = _take(jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1), token_B)
    if params.greedy:
        logp_B = jnp.zeros_like(logp_raw_B)
    elif unchanged(params, logits_BxV.shape[-1]):
        logp_B = logp_raw_B  # the same numbers: x / 1.0 is x, nothing filtered
    else:
        logp_B = _take(jax.nn.log_softmax(processed_BxV, axis=-1), token_B)
    return token_B, logp_B, logp_raw_B


def categorical(keys_B: jax.Array, logits_BxV: jax.Array) -> jax.Array:
    """token[b] = argmax_v(logits[b, v] + g[b, v]), g ~ Gumbel(0, 1) from row b's key: a draw
    from softmax(logits[b]), the same token `jax.random.categorical` draws with that key.

    The argmax is a max, then the first index holding it: XLA:CPU fuses the noise into
    argmax's (value, index) reduction and runs that several times slower than the two plain
    reductions."""
    noisy_BxV = logits_BxV + jax.vmap(
        lambda key: jax.random.gumbel(key, logits_BxV.shape[1:], logits_BxV.dtype))(keys_B)
    max_B1 = jnp.max(noisy_BxV, axis=-1, keepdims=True)
    vocab = logits_BxV.shape[-1]
    first_B = jnp.min(jnp.where(noisy_BxV == max_B1, jnp.arange(vocab), vocab), axis=-1)
    return jnp.minimum(first_B, vocab - 1)  # a NaN row matches nowhere: the last token


def unchanged(params: SamplingParams, vocab_size: int) -> bool:
    """Whether `process_logits` leaves the logits as they are (temperature 1, no filter), so
    the sampled distribution's log-softmax is the model's: one pass over the vocabulary
    instead of two."""
    return (params.temperature == 1 and (params.top_k is None or params.top_k >= vocab_size)
            and (params.top_p is None or params.top_p >= 1))


def _take(values_BxV: jax.Array, index_B: jax.Array) -> jax.Array:
    return jnp.take_along_axis(values_BxV, index_B[:, None], axis=-1)[:, 0]


def sample_rows(keys_B: jax.Array, logits_BxV: jax.Array,
                 params: SamplingParams) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sample_tokens`, run per device on its own rows when a mesh is active.

    Rows are independent, but XLA partitions `lax.top_k` by gathering every row's logits
    onto every device (an all-gather of [B, V] per decode step); under
    `shard_map` each device samples its rows from the full vocabulary it holds.
    """
    active = active_rules()
    if active is None:
        return sample_tokens(keys_B, logits_BxV, params)
    mesh, rules = active
    rows = rules.spec(("batch",), logits_BxV.shape[:1], mesh)
    rows_axes = rows[0] if len(rows) else None
    if rows_axes is None:  # rows not split (or split by a shard_map around this already)
        return sample_tokens(keys_B, logits_BxV, params)
    per_device = jax.shard_map(
        functools.partial(sample_tokens, params=params), mesh=mesh,
        in_specs=(P(rows_axes), P(rows_axes, None)), out_specs=(P(rows_axes),) * 3)
    return per_device(keys_B, logits_BxV)
