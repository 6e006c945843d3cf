"""The rollout's phase programs for FLOP accounting (`jaxrl.step.accounting`): the functions
the step's sampler runs, lowered loop-free for the host CPU, and their analytic counts.

With the engine (`SamplerConfig.engine`, what every run uses by default):

    prefill   decode_loop.begin: the P prompts through the model into a cache of their own
              width, written into the page pool, every row's first token drawn      x 1
    decode    decode_loop.iteration: one iteration of the loop, S slots (the engine's own
              count, `max_concurrent_decodes`) over the call's page pool: the insert of
              waiting rows, one token per slot through the paged attention, sampling
                                                     x rollout/decode_slot_steps / S

The XLA paged attention is a while loop over blocks of pages whose trip count depends on
the slots' lengths; it is compiled unrolled over every block of the page table for every
chunk of slots (`PagedAttentionSettings.unroll`): the iteration of S slots that all reach
their longest row's last page, as the dense count attends over the whole cache. slot steps / S is the
iterations when every iteration ran S slots; the tail's smaller tiers (`slots.shrink`)
count as the share of S they ran. The shapes are the whole batch's on one device, as the
other phases (on a mesh each device runs its own share of slots and rows; the work per
slot is the same).

Without an engine (the dense reference sampler, `jaxrl.rollout.dense_reference`):

    prefill   dense_prefill of the P prompts (a cache of P + C - 1 slots)          x 1
    decode    dense_decode_step + sample_rows of the B = P·G rows   x rollout/decode_slot_steps / B
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxrl.models import KVCache, ModelConfig
from jaxrl.models.paged_attention import chunk_slots
from jaxrl.perf import analytic
from jaxrl.rollout.decode_loop import DecodeSetup, begin, decode_setup, engine_config, iteration
from jaxrl.rollout.dense_reference import dense_decode_step, dense_prefill
from jaxrl.rollout.sampling import sample_rows
from jaxrl.rollout.settings import PagedAttentionSettings
from jaxrl.rollout.slot_count import max_concurrent_decodes
from jaxrl.rollout.types import SamplerConfig


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The static shapes of one RL step."""

    prompts: int  # P
    prompt_len: int  # padded prompt length
    generations: int  # G
    max_new_tokens: int  # C

    @property
    def rows(self) -> int:
        return self.prompts * self.generations


def host_abstract(shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract input on the first CPU device, where the accounting programs are compiled
    (never run)."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(jax.devices("cpu")[0]))


def lower_on_host(fn, *args, donate: tuple[int, ...] = ()) -> jax.stages.Lowered:
    """`fn(*args)` lowered for the host CPU; `donate`: arguments the step updates in place
    (the KV cache, the train state), so XLA's bytes accessed count no copy of them."""
    return jax.jit(fn, donate_argnums=donate).lower(*args)


def engine_setup(model_config: ModelConfig, sampler: SamplerConfig, shapes: StepShapes
                 ) -> DecodeSetup:
    """The engine's `DecodeSetup` of the step's rollout (its slots, its page pool)."""
    return decode_setup(model_config, engine_config(sampler, shapes.rows), shapes.prompts,
                        shapes.prompt_len, shapes.rows, shapes.max_new_tokens,
                        sampler.end_token_ids, sampler.sampling)


def decode_rows(model_config: ModelConfig, sampler: SamplerConfig, shapes: StepShapes) -> int:
    """The rows of the counted decode program: the engine's slots S, or the dense B."""
    if sampler.engine is None:
        return shapes.rows
    return max_concurrent_decodes(engine_setup(model_config, sampler, shapes).config,
                                  shapes.rows)


def lower_generate(graphdef: nnx.GraphDef, params: nnx.State, model_config: ModelConfig,
                   sampler: SamplerConfig, shapes: StepShapes) -> dict[str, jax.stages.Lowered]:
    """{"prefill", "decode"}: the rollout's programs (module docstring), lowered for the
    model of `graphdef`, abstract host `params` and `model_config`."""
    if sampler.engine is None:
        return {"prefill": _dense_prefill(graphdef, params, shapes),
                "decode": _dense_decode(graphdef, params, model_config, sampler, shapes)}
    return _engine(graphdef, params, engine_setup(model_config, sampler, shapes), sampler,
                   shapes)


def _engine(graphdef, params, setup: DecodeSetup, sampler: SamplerConfig, shapes: StepShapes
            ) -> dict[str, jax.stages.Lowered]:
    p, b = shapes.prompts, shapes.rows
    key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    inputs = (host_abstract((p, shapes.prompt_len), jnp.int32),
              host_abstract((p, shapes.prompt_len), jnp.bool_),
              host_abstract((b, *key_data.shape), key_data.dtype),
              host_abstract((b,), jnp.int32))

    def start(params, ids_PxL, mask_PxL, key_data_BxK, limit_B):
        return begin(nnx.merge(graphdef, params), setup, ids_PxL, mask_PxL,
                     jax.random.wrap_key_data(key_data_BxK), limit_B, shapes.max_new_tokens,
                     sampler.pad_token_id)

    progress = jax.tree.map(lambda x: host_abstract(x.shape, x.dtype),
                            jax.eval_shape(start, params, *inputs))
    # The XLA paged attention, its block loop unrolled (module docstring): the host cannot
    # compile the TPU kernel, whose custom call would count as nothing.
    attention = PagedAttentionSettings("xla", setup.config.pages_per_block, unroll=True)

    def decode(params, progress, key_data_BxK):
        return iteration(nnx.merge(graphdef, params), setup, progress,
                         jax.random.wrap_key_data(key_data_BxK), attention)

    return {"prefill": lower_on_host(start, params, *inputs),
            "decode": lower_on_host(decode, params, progress, inputs[2], donate=(1,))}


def _dense_prefill(graphdef, params, shapes: StepShapes) -> jax.stages.Lowered:
    def fn(params, ids_BxP, mask_BxP):
        return dense_prefill(nnx.merge(graphdef, params), ids_BxP, mask_BxP, shapes.max_new_tokens)

    return lower_on_host(fn, params, host_abstract((shapes.prompts, shapes.prompt_len), jnp.int32),
                         host_abstract((shapes.prompts, shapes.prompt_len), jnp.bool_))


def _dense_decode(graphdef, params, cfg: ModelConfig, sampler: SamplerConfig,
                  shapes: StepShapes) -> jax.stages.Lowered:
    b = shapes.rows
    width = shapes.prompt_len + shapes.max_new_tokens - 1
    kv = host_abstract((cfg.num_layers, b, width, cfg.num_kv_heads, cfg.head_dim),
                       cfg.compute_dtype)
    cache = KVCache(kv, kv, host_abstract((b, width), jnp.bool_), host_abstract((), jnp.int32))

    def fn(params, token_B, position_B, cache, key_data_Bx2, t):
        logits_BxV, cache = dense_decode_step(nnx.merge(graphdef, params), token_B, position_B,
                                              cache)
        keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
            jax.random.wrap_key_data(key_data_Bx2), t)
        return sample_rows(keys_B, logits_BxV, sampler.sampling), cache

    rows = host_abstract((b,), jnp.int32)
    return lower_on_host(fn, params, rows, rows, cache, host_abstract((b, 2), jnp.uint32),
                         host_abstract((), jnp.int32), donate=(3,))


def analytic_generate(config: ModelConfig, sampler: SamplerConfig, shapes: StepShapes
                      ) -> tuple[float, float]:
    """(prefill, decode) FLOPs of the programs `lower_generate` counts, analytically."""
    p, c = shapes.prompt_len, shapes.max_new_tokens
    if sampler.engine is None:
        return (analytic.prefill_flops(config, shapes.prompts, p, c),
                analytic.decode_step_flops(config, shapes.rows, p, c))
    setup = engine_setup(config, sampler, shapes)
    layout, s = setup.layout, decode_rows(config, sampler, shapes)
    block = min(setup.config.pages_per_block, layout.table_width)
    keys = -(-layout.table_width // block) * block * layout.page_size
    chunk = min(s, chunk_slots(s))
    return (analytic.engine_prefill_flops(config, shapes.prompts, p),
            analytic.paged_decode_flops(config, s, keys, -(-s // chunk) * chunk))
