"""A rollout in pieces, each decoded with the newest weights: in-flight weight updates.

    partial = start(model, config, prompts, key, version=v, stop_at=s)   prefill, s decodes
    partial = resume(model2, config, partial, version=v + 1, stop_at=2 * s)
    partial = resume(model3, config, partial, version=v + 2)             to the end
    rollout, version_BxC = finish(config, partial)

PipelineRL's in-flight weight updates: between two pieces the policy changes and the live
rows go on under the new weights; no row is dropped or restarted, and the keys and values
written before stay as they were (PipelineRL does not recompute them either). Each token
records the version of the weights that drew it (`version_BxC`, -1 where no token was drawn),
and its log-probs in the rollout are the sampler's under exactly those weights and that
cache: the behaviour probabilities an importance ratio needs, token by token. With the same
weights in every piece the rollout is `sample_continuous`'s, token for token (tested).

A rollout in pieces keeps its slot count (`rollout.min_slots` does not apply). `Partial` is a
pytree of arrays only (the call's key kept as raw bits), so it can cross program boundaries
and be checkpointed; `constrain_partial` / `partial_shardings` give it one layout on a mesh,
so the program that resumes it compiles once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from jaxrl.models import Transformer
from jaxrl.rollout.decode_loop import InProgress, advance, begin, engine_config, plan, to_rollout
from jaxrl.rollout.types import Rollout, SamplerConfig, row_keys, row_limits
from jaxrl.sharding import AxisRules, constrain

# Name endings of arrays laid out by rows (rows, slots or prompts first).
_ROW_SUFFIXES = ("_B", "_BxC", "_S", "_SxM", "_SxK", "_P", "_PxL")
_KV_AXES = ("layers", None, None, "act_kv_heads", "head_dim")


@struct.dataclass
class Partial:
    """A rollout stopped between two decode iterations, with what it needs to go on."""

    progress: InProgress
    version_BxC: jax.Array  # int32: the weight version that drew each token (-1: none)
    key_bits: jax.Array  # the call's key (`jax.random.key_data`)
    prompt_ids_PxL: jax.Array
    prompt_mask_PxL: jax.Array

    @property
    def finished(self) -> jax.Array:
        return self.progress.finished


def _plan(model: Transformer, config: SamplerConfig, prompt_ids_PxL: jax.Array):
    num_prompts, prompt_len = prompt_ids_PxL.shape
    b = num_prompts * config.num_generations
    return plan(model.config, engine_config(config, b), num_prompts, prompt_len, b,
                config.max_new_tokens, config.stop_token_ids, config.sampling)


def start(model: Transformer, config: SamplerConfig, prompt_ids_PxL: jax.Array,
          prompt_mask_PxL: jax.Array, key: jax.Array, version: jax.Array,
          stop_at: jax.Array | None = None) -> Partial:
    """The prompts prefilled and decoded for up to `stop_at` iterations (None: to the end)
    by the weights of `model`, version `version`."""
    num_prompts = prompt_ids_PxL.shape[0]
    keys_B = row_keys(key, num_prompts, config.num_generations)
    limit_B = row_limits(None, keys_B.shape[0], config.max_new_tokens)
    progress = begin(model, _plan(model, config, prompt_ids_PxL), prompt_ids_PxL,
                     prompt_mask_PxL, keys_B, limit_B, config.max_new_tokens,
                     config.pad_token_id)
    version_BxC = jnp.where(progress.out.mask_BxC, jnp.int32(version), -1)
    partial = Partial(progress, version_BxC, jax.random.key_data(key), prompt_ids_PxL,
                      prompt_mask_PxL)
    return resume(model, config, partial, version, stop_at)


def resume(model: Transformer, config: SamplerConfig, partial: Partial, version: jax.Array,
           stop_at: jax.Array | None = None) -> Partial:
    """`partial` decoded on by the weights of `model` (version `version`) until every row has
    finished, or `stop_at` decode iterations have run since `start`."""
    keys_B = row_keys(jax.random.wrap_key_data(partial.key_bits), partial.prompt_ids_PxL.shape[0],
                      config.num_generations)
    before_BxC = partial.progress.out.mask_BxC
    progress = advance(model, _plan(model, config, partial.prompt_ids_PxL), partial.progress,
                       keys_B, stop_at)
    drawn_BxC = progress.out.mask_BxC & ~before_BxC
    return partial.replace(progress=progress, version_BxC=jnp.where(
        drawn_BxC, jnp.int32(version), partial.version_BxC))


def finish(config: SamplerConfig, partial: Partial) -> tuple[Rollout, jax.Array]:
    """(rollout, version_BxC) of a finished `partial` (`Partial.finished`)."""
    rollout = to_rollout(partial.progress.out, partial.prompt_ids_PxL, partial.prompt_mask_PxL,
                         config.num_generations, partial.progress.slot_steps)
    return rollout, constrain(partial.version_BxC, ("batch", None))


def _axes(path, x) -> tuple[str | None, ...]:
    name = getattr(path[-1], "name", "")
    if name == "kv_pages":
        return _KV_AXES
    if name.endswith(_ROW_SUFFIXES) and x.ndim:
        return ("batch",) + (None,) * (x.ndim - 1)
    return (None,) * x.ndim


def constrain_partial(partial: Partial) -> Partial:
    """`partial` in its one layout under the active rules (rows split over `batch`, the pool
    by its kv heads, the rest replicated); a no-op outside `use_rules`."""
    return jax.tree_util.tree_map_with_path(lambda p, x: constrain(x, _axes(p, x)), partial)


def partial_shardings(partial: Partial, mesh: Mesh, rules: AxisRules) -> Partial:
    """The shardings of `constrain_partial`'s layout on `mesh` (for abstract arrays too)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: rules.sharding(_axes(p, x), x.shape, mesh), partial)
