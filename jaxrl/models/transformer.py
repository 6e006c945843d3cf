"""Decoder-only transformer (Llama 3.x / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral) as a
Flax NNX module.

    x = embed[input_ids]
    for each layer:  x += attn(rmsnorm(x));  x += mlp(rmsnorm(x))   (mlp: SwiGLU, or MoE)
    logits = rmsnorm(x) @ (embed^T if tied else lm_head)

Two entry points share all code: `__call__` (training/scoring: the given tokens only) and
`extend` (sampling: append tokens to a KV cache and attend over it; prefill is `extend` of
the prompt on an empty cache, decoding `extend` of one token).
`hidden_states_shared_prompt` is the training forward of G rows per prompt with the prompt
run once per group (GRPO's rows share their prompt: its work shrinks G-fold). With
`scan_layers` the layers are stacked on a leading `layers` axis and run by `nnx.scan`, so
compile time does not grow with depth. `remat` rematerialises each block for the backward
pass of the uncached forward (`__call__`, `hidden_states`): it changes what is saved vs
recomputed, never the numbers; `extend` takes no gradients and runs without it. Logits are
always float32. For a mixture of experts, `hidden_states(..., router_stats=True)` (and its
shared-prompt twin) also return the router statistics summed over layers (`moe.router_stats`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.attention import (
    Attention,
    PagedKV,
    cache_causal_mask,
    causal_mask,
    segment_causal_mask,
)
from jaxrl.models.attention_kernels import PaddedRows
from jaxrl.models.config import ModelConfig, Remat
from jaxrl.models.dense import DENSE
from jaxrl.models.layers import MLP, RMSNorm, normal, param, rope_inverse_frequencies
from jaxrl.models.moe import MoE
from jaxrl.sharding import constrain

CACHE_AXES = ("layers", "batch", "cache_seq", "act_kv_heads", "head_dim")

# The jax.checkpoint policy (which intermediates a block's backward pass reads from memory)
# of each `remat`. "save_dots" keeps the outputs of dots without batch dimensions: in a block
# those are the weight projections (q/k/v/o, gate/up/down), linear in T and nearly all of
# its FLOPs, so the backward pass recomputes only the cheap rest. The attention dots
# (scores and their product with v) have batch dimensions (batch, heads) and are recomputed:
# the [B, N, T, S] scores grow with T^2, `checkpoint_dots` would keep them.
_REMAT_POLICIES = {
    "block": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(DENSE)),  # the projections (`dense`)
}


class KVCache(NamedTuple):
    """Keys/values of every layer, preallocated for `max_len` slots.

    k, v: [layers, batch, slots, kv_heads, head_dim]. `valid_BxS` marks slots holding real
    tokens (left padding is invalid). `end` is the number of slots written so far; it is the
    same for every row because prompts are left-padded to one length.
    """

    k: jax.Array
    v: jax.Array
    valid_BxS: jax.Array
    end: jax.Array

    @classmethod
    def init(cls, config: ModelConfig, batch_size: int, max_len: int,
             dtype: jnp.dtype | None = None) -> KVCache:
        shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
        dtype = config.compute_dtype if dtype is None else dtype
        # Two buffers, not one array twice: a step that donates the cache donates both.
        k, v = (constrain(jnp.zeros(shape, dtype), CACHE_AXES) for _ in range(2))
        return cls(k, v, jnp.zeros((batch_size, max_len), bool), jnp.zeros((), jnp.int32))


def default_positions(attention_mask_BxT: jax.Array) -> jax.Array:
    """Position of each token counting only real tokens (left padding gets position 0)."""
    return jnp.maximum(jnp.cumsum(attention_mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


class Block(nnx.Module):
    """Pre-norm residual block: attention then SwiGLU MLP (or mixture of experts)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.hidden_size, "embed", config.rms_norm_eps, config)
        self.attn = Attention(config, rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, "embed", config.rms_norm_eps, config)
        self.mlp = MoE(config, rngs) if config.num_experts else MLP(config, rngs)

    def __call__(self, x_BxTxE, positions_BxT, inv_freq_H2, mask_BxTxS, cache=None,
                 valid_BxT=None):
        """(x, cache); with `valid_BxT` (MoE only) ((x, router_stats_2xX), cache)."""
        h_BxTxE, cache = self.attn(self.attn_norm(x_BxTxE), positions_BxT, inv_freq_H2,
                                   mask_BxTxS, cache)
        return self._mlp_residual(x_BxTxE + h_BxTxE, valid_BxT), cache

    def _mlp_residual(self, x_BxTxE, valid_BxT):
        x_BxTxE = constrain(x_BxTxE, ("batch", "seq", "act_embed"))
        if valid_BxT is None:
            x_BxTxE = x_BxTxE + self.mlp(self.mlp_norm(x_BxTxE))
            return constrain(x_BxTxE, ("batch", "seq", "act_embed"))
        y_BxTxE, stats_2xX = self.mlp.with_stats(self.mlp_norm(x_BxTxE), valid_BxT)
        return constrain(x_BxTxE + y_BxTxE, ("batch", "seq", "act_embed")), stats_2xX

    def shared_prompt(self, x_NxPxE, x_BxCxE, positions_NxP, positions_BxC, inv_freq_H2,
                      mask_NxPxP, mask_BxCxS, valid=None):
        """The block on N prompts and their B = N·G continuations (`Attention.shared_prompt`);
        everything but attention is per token, so it runs on each part as it is. With
        `valid` = (valid_NxP, valid_BxC) (MoE only): ((x_p, x_c), router_stats_2xX)."""
        h_NxPxE, h_BxCxE = self.attn.shared_prompt(
            self.attn_norm(x_NxPxE), self.attn_norm(x_BxCxE), positions_NxP, positions_BxC,
            inv_freq_H2, mask_NxPxP, mask_BxCxS)
        parts = (x_NxPxE + h_NxPxE, x_BxCxE + h_BxCxE)
        if valid is None:
            return tuple(self._mlp_residual(x, None) for x in parts)
        (x_p, stats_p), (x_c, stats_c) = (self._mlp_residual(x, v)
                                          for x, v in zip(parts, valid, strict=True))
        return (x_p, x_c), stats_p + stats_c


def _block_forward(remat: Remat, *, in_scan: bool, shared_prompt: bool = False,
                   valid=None):
    """`block(x, positions, inv_freq, mask) -> x` (no cache), rematerialised per `remat`;
    with `shared_prompt`, `block.shared_prompt` on ((x_p, x_c), (pos_p, pos_c), inv_freq,
    (mask_p, mask_c)) -> (x_p, x_c). With `valid` (the token weights of the router
    statistics: valid_BxT, or (valid_NxP, valid_BxC) with `shared_prompt`), x is the pair
    (x, router_stats_2xX summed over the layers so far)."""
    def forward(block, x_BxTxE, positions_BxT, inv_freq_H2, mask_BxTxS):
        if valid is not None:
            x_BxTxE, stats_2xX = x_BxTxE
        if shared_prompt:
            out = block.shared_prompt(*x_BxTxE, *positions_BxT, inv_freq_H2, *mask_BxTxS,
                                      valid=valid)
        else:
            out = block(x_BxTxE, positions_BxT, inv_freq_H2, mask_BxTxS, valid_BxT=valid)[0]
        if valid is None:
            return out
        return out[0], stats_2xX + out[1]

    if remat == "none":
        return forward
    # Unrolled, XLA's CSE would merge the recomputation with the forward pass it repeats
    # (undoing the remat) unless prevented; inside a scan the forward and backward loops are
    # separate already, and the barriers that prevent it only cost time (notably on GPU).
    return nnx.remat(forward, policy=_REMAT_POLICIES[remat], prevent_cse=not in_scan)


def _stacked_blocks(config: ModelConfig, rngs: nnx.Rngs) -> Block:
    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=config.num_layers,
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return Block(config, rngs)

    return make(rngs)


class Transformer(nnx.Module):
    """The policy/reference model: token ids in, float32 logits out."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = param(normal(rngs, (config.vocab_size, config.hidden_size), config),
                           ("vocab", "embed"))
        if config.scan_layers:
            self.layers = _stacked_blocks(config, rngs)
        else:
            self.layers = nnx.List([Block(config, rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.hidden_size, "embed", config.rms_norm_eps, config)
        if not config.tie_word_embeddings:
            self.lm_head = param(normal(rngs, (config.hidden_size, config.vocab_size), config),
                                 ("embed", "vocab"))

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None) -> jax.Array:
        """Logits [B, T, V] of token ids [B, T], possibly left-padded (mask 0 = padding).

        `positions` default to counting the real tokens of each row; logits at padded
        positions are garbage for the caller to mask.
        """
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, bool)
        if positions is None:
            positions = default_positions(attention_mask)
        return self.forward_embeddings(self.embed_tokens(input_ids), positions, attention_mask)

    def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array, *,
                      router_stats: bool = False):
        """The final-norm hidden states [B, T, E] (compute dtype) that `__call__` projects to
        logits with `output_embedding()`: for losses that never materialise [B, T, V].
        With `router_stats` (MoE): (hidden, router_stats_2xX of the real tokens, summed over
        the layers)."""
        return self._hidden(input_ids, default_positions(attention_mask),
                            self._self_mask(attention_mask), attention_mask, router_stats)

    def hidden_states_packed(self, ids_RxL: jax.Array, positions_RxL: jax.Array,
                             segments_RxL: jax.Array, *, router_stats: bool = False):
        """`hidden_states` of packed rows: sequences end to end (segment s > 0: one; 0:
        padding), each at its own `positions`, attending within its segment only (XLA's
        attention whatever `attention_impl`); as one row each, to float rounding (router
        statistics: the tokens of segments > 0)."""
        mask_RxLxL = segment_causal_mask(segments_RxL, self.config.sliding_window)
        return self._hidden(ids_RxL, positions_RxL, mask_RxLxL, segments_RxL > 0, router_stats)

    def _hidden(self, ids_BxT, positions_BxT, mask, valid_BxT, router_stats):
        x_BxTxE = self.embed_tokens(ids_BxT)
        if router_stats:
            x_BxTxE, stats_2xX = self._run_blocks(
                _block_forward(self.config.remat, in_scan=self.config.scan_layers,
                               valid=self._router_valid(valid_BxT)),
                (x_BxTxE, self._zero_stats()), positions_BxT, mask)
            return self.final_norm(x_BxTxE), stats_2xX
        x_BxTxE, _ = self._layers(x_BxTxE, positions_BxT, mask, None)
        return self.final_norm(x_BxTxE)

    def _router_valid(self, attention_mask_BxT):
        if not self.config.num_experts:
            raise ValueError(f"router_stats=True needs a mixture-of-experts model; "
                             f"{self.config.model_type} has no router")
        return attention_mask_BxT.astype(jnp.float32)

    def _zero_stats(self):
        return jnp.zeros((2, self.config.num_experts), jnp.float32)

    def hidden_states_shared_prompt(self, prompt_ids_NxP: jax.Array, prompt_mask_NxP: jax.Array,
                                    ids_BxC: jax.Array, mask_BxC: jax.Array, *,
                                    router_stats: bool = False) -> tuple[jax.Array, ...]:
        """`hidden_states` of the B = N·G rows prompt[b // G] ⊕ ids[b], split as (prompt part
        [N, P, E], continuation part [B, C, E]), with each prompt run once for its G rows.

        The prompt part of a row attends only to the prompt (causal), so it is the same for
        the G rows that share it; the continuations attend over their prompt's keys and
        values. Same numbers as `hidden_states` of the concatenated rows (to float rounding:
        the prompt's gradients arrive summed over the group instead of one row at a time).
        With `router_stats` (MoE) the router statistics are appended, a prompt's tokens
        weighted by its G rows (the statistics of `hidden_states` of the rows).
        """
        n, b = prompt_ids_NxP.shape[0], ids_BxC.shape[0]
        if b % n:
            raise ValueError(f"{b} continuation rows do not split into groups of the "
                             f"{n} prompts (expected a multiple of {n})")
        window = self.config.sliding_window
        positions_NxP = default_positions(prompt_mask_NxP)
        prompt_valid_BxP = jnp.repeat(prompt_mask_NxP.astype(bool), b // n, axis=0)
        valid_BxS = jnp.concatenate([prompt_valid_BxP, mask_BxC.astype(bool)], axis=1)
        p, c = prompt_ids_NxP.shape[1], ids_BxC.shape[1]
        positions_BxC = default_positions(valid_BxS)[:, p:]
        masks = (causal_mask(prompt_mask_NxP, window), cache_causal_mask(valid_BxS, p, c, window))
        xs = (self.embed_tokens(prompt_ids_NxP), self.embed_tokens(ids_BxC))
        valid = None
        if router_stats:
            valid = (self._router_valid(prompt_mask_NxP) * (b // n), self._router_valid(mask_BxC))
            xs = (xs, self._zero_stats())
        out = self._run_blocks(
            _block_forward(self.config.remat, in_scan=self.config.scan_layers,
                           shared_prompt=True, valid=valid),
            xs, (positions_NxP, positions_BxC), masks)
        if router_stats:
            (x_NxPxE, x_BxCxE), stats_2xX = out
            return self.final_norm(x_NxPxE), self.final_norm(x_BxCxE), stats_2xX
        x_NxPxE, x_BxCxE = out
        return self.final_norm(x_NxPxE), self.final_norm(x_BxCxE)

    def output_embedding(self) -> jax.Array:
        """The output projection [E, V] in the compute dtype (embed^T when tied)."""
        dt = self.config.compute_dtype
        if self.config.tie_word_embeddings:
            return self.embed[...].astype(dt).T
        return self.lm_head[...].astype(dt)

    def embed_tokens(self, input_ids_BxT: jax.Array) -> jax.Array:
        x_BxTxE = self.embed[...][input_ids_BxT].astype(self.config.compute_dtype)
        return constrain(x_BxTxE, ("batch", "seq", "act_embed"))

    def forward_embeddings(self, x_BxTxE: jax.Array, positions_BxT: jax.Array,
                           attention_mask_BxT: jax.Array) -> jax.Array:
        """Logits from input embeddings (soft prompts, or gradients w.r.t. the inputs)."""
        x_BxTxE, _ = self._layers(x_BxTxE, positions_BxT, self._self_mask(attention_mask_BxT),
                                  None)
        return self._logits(x_BxTxE)

    def _self_mask(self, attention_mask_BxT):
        """The uncached forward's mask: dense for XLA's attention, the rows' real tokens for
        a kernel (`jaxrl.models.attention_kernels`)."""
        if self.config.attention_impl == "xla":
            return causal_mask(attention_mask_BxT, self.config.sliding_window)
        return PaddedRows(attention_mask_BxT.astype(bool))

    def extend(self, input_ids: jax.Array, positions: jax.Array, cache: KVCache,
               attention_mask: jax.Array | None = None, *,
               last_only: bool = False) -> tuple[jax.Array, KVCache]:
        """Appends T tokens at cache slot `cache.end`; returns their logits and the new cache.

        With `last_only` the logits are those of the last column only ([B, 1, V]): a prefill
        needs no more, and skips the vocabulary projection of every other prompt token.
        The caller keeps `cache.end + T` within the cache (a traced `end` cannot be checked
        here, and XLA clamps an out-of-range write onto the last slots).
        """
        num_new, max_len = input_ids.shape[1], cache.valid_BxS.shape[1]
        if num_new > max_len:
            raise ValueError(f"cannot append {num_new} tokens to a KV cache of {max_len} slots")
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, bool)
        valid_BxS = jax.lax.dynamic_update_slice(
            cache.valid_BxS, attention_mask.astype(bool), (0, cache.end))
        mask_BxTxS = cache_causal_mask(valid_BxS, cache.end, num_new, self.config.sliding_window)
        x_BxTxE, (k, v) = self._layers(self.embed_tokens(input_ids), positions, mask_BxTxS,
                                       (cache.k, cache.v, cache.end))
        new_cache = KVCache(constrain(k, CACHE_AXES), constrain(v, CACHE_AXES), valid_BxS,
                            cache.end + num_new)
        if last_only:
            x_BxTxE = x_BxTxE[:, -1:]
        return self._logits(x_BxTxE), new_cache

    def decode_paged(self, token_S: jax.Array, position_S: jax.Array, paged: PagedKV,
                     ) -> tuple[jax.Array, jax.Array]:
        """One token per slot through a paged KV pool: (logits_SxV, the updated pool).

        Each slot's token, at `position_S`, is written into its page and attends over the
        slot's first `paged.length_S` tokens (itself included); see `PagedKV`.
        """
        x_Sx1xE = self.embed_tokens(token_S[:, None])
        x_Sx1xE, kv_pages = self._layers(x_Sx1xE, position_S[:, None], None, paged)
        return self._logits(x_Sx1xE)[:, 0], kv_pages

    def _layers(self, x_BxTxE, positions_BxT, mask_BxTxS, cache):
        if isinstance(cache, PagedKV):
            return self._paged_layers(x_BxTxE, positions_BxT, cache)
        inv_freq_H2 = rope_inverse_frequencies(self.config)
        remat, scan = self.config.remat, self.config.scan_layers
        if cache is None:
            return self._run_blocks(_block_forward(remat, in_scan=scan), x_BxTxE,
                                    positions_BxT, mask_BxTxS), None

        if not scan:
            kv = cache[:2]
            for i, block in enumerate(self.layers):
                x_BxTxE, kv = block(x_BxTxE, positions_BxT, inv_freq_H2, mask_BxTxS,
                                    (*kv, i, cache[2]))
            return x_BxTxE, kv

        @nnx.scan(in_axes=(0, 0, nnx.Carry), out_axes=nnx.Carry)
        def run_cached(block, layer, carry):
            x, k, v = carry
            x, (k, v) = block(x, positions_BxT, inv_freq_H2, mask_BxTxS, (k, v, layer, cache[2]))
            return x, k, v

        x_BxTxE, k, v = run_cached(self.layers, jnp.arange(self.config.num_layers),
                                   (x_BxTxE, cache[0], cache[1]))
        return x_BxTxE, (k, v)

    def _run_blocks(self, forward, x, positions, masks):
        """x through every block by `forward` (`_block_forward`), no cache: a loop over the
        layers, or one `nnx.scan` over the stacked layers (x may be a tuple of arrays)."""
        inv_freq_H2 = rope_inverse_frequencies(self.config)
        if not self.config.scan_layers:
            for block in self.layers:
                x = forward(block, x, positions, inv_freq_H2, masks)
            return x

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, x):
            return forward(block, x, positions, inv_freq_H2, masks)

        return run(self.layers, x)

    def _paged_layers(self, x_BxTxE, positions_BxT, paged: PagedKV):
        inv_freq_H2 = rope_inverse_frequencies(self.config)
        if not self.config.scan_layers:
            kv_pages = paged.kv_pages
            for i, block in enumerate(self.layers):
                x_BxTxE, kv_pages = block(x_BxTxE, positions_BxT, inv_freq_H2, None,
                                          paged._replace(kv_pages=kv_pages, layer=i))
            return x_BxTxE, kv_pages

        @nnx.scan(in_axes=(0, 0, nnx.Carry), out_axes=nnx.Carry)
        def run_paged(block, layer, carry):
            x, kv_pages = carry
            return block(x, positions_BxT, inv_freq_H2, None,
                         paged._replace(kv_pages=kv_pages, layer=layer))

        return run_paged(self.layers, jnp.arange(self.config.num_layers),
                         (x_BxTxE, paged.kv_pages))

    def _logits(self, x_BxTxE: jax.Array) -> jax.Array:
        x_BxTxE = self.final_norm(x_BxTxE)
        dt = self.config.compute_dtype
        if self.config.tie_word_embeddings:
            logits = jnp.einsum("bte,ve->btv", x_BxTxE, self.embed[...].astype(dt),
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("bte,ev->btv", x_BxTxE, self.lm_head[...].astype(dt),
                                preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "act_vocab"))
