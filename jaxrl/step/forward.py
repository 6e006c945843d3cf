"""The trainer's forward: the policy's hidden states and log-probs at the completion tokens.

    hidden_BxCxE      = completion_hidden(model, batch)         (+ MoE router statistics)
    logp_BxC, H_BxC   = completion_log_probs(model, batch, T)   log-probs and entropies at T

The hidden state at position t predicts token t + 1, so completion token i is read at
P - 1 + i. `prompt_group` decides when the G rows of a group run their shared prompt once
(`Transformer.hidden_states_shared_prompt`: same numbers, the prompt's work G-fold smaller).
Used by the updates (`jaxrl.step.phases`), the critic (`jaxrl.step.critic`) and the FLOP
accounting (`jaxrl.step.accounting`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config.algo import AlgoSection, resolve_logprob_chunk
from jaxrl.models import ModelConfig
from jaxrl.models.dense import dense
from jaxrl.rl import chunked_log_probs_and_entropy, token_entropy, token_log_probs
from jaxrl.sharding.rules import constrain

Batch = dict[str, jax.Array]


def prompt_group(cfg: AlgoSection, model_config: ModelConfig, group_size: int, rows: int,
                 slices: int, batch_shards: int = 1) -> int:
    """Rows sharing one prompt within each of `slices` strided row slices (`_split`) of a
    batch of `rows` group-major rows (G = `group_size` consecutive rows per prompt): the
    factor by which `completion_log_probs` cuts the prompt's work; 1: each row runs its own.

    Slice i of n holds rows i, i + n, ..., so when n divides G it holds G / n rows of every
    prompt, consecutive. Besides algo.share_prompts, sharing takes the XLA attention (the
    shared forward's masks are dense; the cuDNN / Splash kernels take one padded sequence
    per row) and a prompt count per slice that the `batch_shards` devices holding the rows
    divide (else the largest divisor of G / n that gives one: no device idles).
    """
    if (not cfg.share_prompts or model_config.attention_impl != "xla" or group_size % slices
            or rows % slices):
        return 1
    group, per_slice = group_size // slices, rows // slices
    return next((d for d in range(group, 1, -1) if group % d == 0 and per_slice % d == 0
                 and (per_slice // d) % batch_shards == 0), 1)


def completion_hidden(model: nnx.Module, batch: Batch, prompt_group: int = 1, *,
                      router_stats: bool = False) -> tuple[jax.Array, ...]:
    """(hidden_BxCxE,): `model`'s final hidden states at the C positions that predict the
    completion tokens (`prompt_group`: see `completion_log_probs`); with `router_stats`
    (a mixture of experts), (hidden_BxCxE, router_stats_2xX) of the rows."""
    c = batch["loss_mask_BxC"].shape[1]
    ids_BxT, mask_BxT = batch["ids_BxT"], batch["mask_BxT"]
    # The hidden state at position t predicts token t + 1: completion token i is predicted
    # at P - 1 + i.
    if prompt_group > 1:
        p, g = ids_BxT.shape[1] - c, prompt_group
        prompt_NxPxE, completion_BxCxE, *stats = model.hidden_states_shared_prompt(
            ids_BxT[::g, :p], mask_BxT[::g, :p], ids_BxT[:, p:], mask_BxT[:, p:],
            router_stats=router_stats)
        return (jnp.concatenate([jnp.repeat(prompt_NxPxE[:, -1:], g, axis=0),
                                 completion_BxCxE[:, :-1]], axis=1), *stats)
    out = model.hidden_states(ids_BxT, mask_BxT, router_stats=router_stats)
    hidden_BxTxE, *stats = out if router_stats else (out,)
    return (hidden_BxTxE[:, -c - 1:-1], *stats)


def completion_log_probs(model: nnx.Module, batch: Batch, temperature: float,
                         chunk_size: int | str | None = None, *, unroll: bool = False,
                         prompt_group: int = 1, hidden_BxCxE: jax.Array | None = None,
                         ) -> tuple[jax.Array, jax.Array]:
    """(logp_BxC, entropy_BxC) of the completion tokens under `model` given their prefix.

    Only the C positions that predict completion tokens are projected onto the vocabulary.
    With `chunk_size` ("auto": `resolve_logprob_chunk`) the projection runs
    in chunks of that many columns
    (`chunked_log_probs_and_entropy`), so [B, C, V] logits never exist at once; `unroll`
    unrolls that chunk loop (FLOP accounting: XLA's cost analysis counts a loop body once).
    With `prompt_group` g > 1 (`prompt_group()`), rows b·g ... b·g + g - 1 share their prompt
    and it runs once for them (`Transformer.hidden_states_shared_prompt`). `hidden_BxCxE`:
    `completion_hidden` computed already (a value head reads it too).
    """
    chunk_size = resolve_logprob_chunk(chunk_size, model.config.vocab_size)
    targets_BxC = batch["ids_BxT"][:, -batch["loss_mask_BxC"].shape[1]:]
    if hidden_BxCxE is None:
        hidden_BxCxE = completion_hidden(model, batch, prompt_group)[0]
    if chunk_size is not None:
        return chunked_log_probs_and_entropy(
            hidden_BxCxE, model.output_embedding(), targets_BxC, temperature=temperature,
            chunk_size=chunk_size, unroll=unroll)
    logits_BxCxV = constrain(dense(hidden_BxCxE, model.output_embedding(), "bce,ev->bcv",
                                   jnp.float32), ("batch", "seq", "act_vocab"))
    return (token_log_probs(logits_BxCxV, targets_BxC, temperature),
            token_entropy(logits_BxCxV, temperature))
