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

On a mesh (under `use_rules`) the rows, slots and pages are split over the devices of the
rollout rules' batch axes as the one-piece rollout splits them (`decode_loop.rollout_on_mesh`:
each device its own rows, slots and pool, no collective over those axes per decode step), and
stay split between pieces: the `Partial`'s progress is the D devices' progress side by side
(each array's first axis, the pool's page axis; a device's scalar counts are [D] there), its
row keys, limits and queue those of the device's own rows. Each device runs up to `stop_at`
iterations of its own. So a `Partial` made on D devices resumes on D devices of that layout.

A rollout in pieces keeps its slot count (`rollout.engine.min_slots` does not apply). `Partial` is a
pytree of arrays only (the call's key kept as raw bits), so it can cross program boundaries
and be checkpointed; `constrain_partial` / `partial_shardings` give it one layout on a mesh,
so the program that resumes it compiles once.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.models import Transformer
from jaxrl.rollout import slots
from jaxrl.rollout.decode_loop import (
    InProgress,
    advance,
    begin,
    decode_setup,
    device_share,
    engine_config,
    row_axes,
    to_rollout,
)
from jaxrl.rollout.slots_on_mesh import leaf_name, pool_spec
from jaxrl.rollout.types import Rollout, SamplerConfig, row_keys, row_limits
from jaxrl.sharding import AxisRules, constrain, use_rules
from jaxrl.sharding.rules import active_rules

# Name endings of arrays laid out by rows (rows, slots or prompts first).
_ROW_SUFFIXES = ("_B", "_BxC", "_S", "_SxM", "_SxK", "_P", "_PxL")
# A device's scalar counts in its progress: [D] in a split `Partial`, one entry each.
_SCALARS = frozenset({"count", "num_queued", "next_", "steps", "slot_steps"})


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
        p = self.progress
        return jnp.all(p.next_ >= p.num_queued) & ~jnp.any(p.state.live_S)


@dataclasses.dataclass(frozen=True)
class _Devices:
    """The devices that split a call's rows (the batch axes of the active rules that divide
    them), and each device's share of the call: its engine settings and rows' homes."""

    mesh: Mesh
    rules: AxisRules
    axes: tuple[str, ...]

    @classmethod
    def active(cls, num_rows: int) -> _Devices | None:
        """None: no rules active, or no batch axis divides the rows (one piece)."""
        active = active_rules()
        axes = () if active is None else row_axes(*active, num_rows)
        return cls(*active, axes) if axes else None

    @property
    def d(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    def run(self, fn, in_specs, *args):
        """fn(*args) on every device under the rules less the split axes; `fn` returns a
        progress piece, which comes back as the devices' pieces side by side."""
        treedef = []

        def per_device(*args):
            with use_rules(jax.sharding.get_abstract_mesh(), self.rules.without(self.axes)):
                packed, tree = _pack(_pieces(fn(*args)))
            treedef.append(tree)
            return packed

        packed = jax.shard_map(per_device, mesh=self.mesh, in_specs=in_specs,
                               out_specs=(P(None, self.axes), P(self.axes)),
                               axis_names=set(self.axes), check_vma=False)(*args)
        return _unpack(packed, treedef[-1])


def _setup(model_config, config: SamplerConfig, num_prompts: int, prompt_len: int,
           num_rows: int, engine=None):
    return decode_setup(model_config, engine or engine_config(config, num_rows), num_prompts,
                        prompt_len, num_rows, config.max_new_tokens, config.end_token_ids,
                        config.sampling)


def _share(config: SamplerConfig, devices: _Devices, num_rows: int, num_prompts: int):
    """(engine settings, home_B, prompts spec) of one device's share of the call."""
    local, home_B = device_share(engine_config(config, num_rows), num_rows, num_prompts,
                                 devices.d)
    return local, home_B, P(devices.axes) if num_prompts % devices.d == 0 else P()


def _begin(model: Transformer, config: SamplerConfig, prompt_ids_PxL, prompt_mask_PxL,
           keys_B, limit_B) -> InProgress:
    """`decode_loop.begin` of the call, on each device for its own rows when split."""
    (num_prompts, width), b = prompt_ids_PxL.shape, keys_B.shape[0]
    c, pad = config.max_new_tokens, config.pad_token_id
    devices = _Devices.active(b)
    if devices is None:
        return begin(model, _setup(model.config, config, num_prompts, width, b), prompt_ids_PxL,
                     prompt_mask_PxL, keys_B, limit_B, c, pad)
    local, home_B, prompts = _share(config, devices, b, num_prompts)
    graphdef, weights = nnx.split(model)

    def one(weights, ids_PxL, mask_PxL, keys_BxK, limit_B, home_B):
        model = nnx.merge(graphdef, weights)
        setup = _setup(model.config, config, ids_PxL.shape[0], width, keys_BxK.shape[0], local)
        return begin(model, setup, ids_PxL, mask_PxL, jax.random.wrap_key_data(keys_BxK),
                     limit_B, c, pad, home_B)

    rows = P(devices.axes)
    return devices.run(one, (P(), prompts, prompts, rows, rows, rows), weights, prompt_ids_PxL,
                       prompt_mask_PxL, jax.random.key_data(keys_B), limit_B, home_B)


def _advance(model: Transformer, config: SamplerConfig, partial: Partial, keys_B,
             stop_at) -> InProgress:
    """`decode_loop.advance` of the call, each device on its own piece when split."""
    (num_prompts, width), b = partial.prompt_ids_PxL.shape, keys_B.shape[0]
    devices = _Devices.active(b)
    if devices is None:
        return advance(model, _setup(model.config, config, num_prompts, width, b),
                       partial.progress, keys_B, stop_at)
    local, _, _ = _share(config, devices, b, num_prompts)
    local_prompts = num_prompts // devices.d if num_prompts % devices.d == 0 else num_prompts
    graphdef, weights = nnx.split(model)
    packed, treedef = _pack(partial.progress)
    stop_at = jnp.iinfo(jnp.int32).max if stop_at is None else stop_at

    def one(weights, keys_BxK, stop_at, packed):
        model = nnx.merge(graphdef, weights)
        setup = _setup(model.config, config, local_prompts, width, keys_BxK.shape[0], local)
        return advance(model, setup, _own(_unpack(packed, treedef)),
                       jax.random.wrap_key_data(keys_BxK), stop_at)

    specs = (P(None, devices.axes), P(devices.axes))
    return devices.run(one, (P(), P(devices.axes), P(), specs), weights,
                       jax.random.key_data(keys_B), jnp.asarray(stop_at, jnp.int32), packed)


def start(model: Transformer, config: SamplerConfig, prompt_ids_PxL: jax.Array,
          prompt_mask_PxL: jax.Array, key: jax.Array, version: jax.Array,
          stop_at: jax.Array | None = None) -> Partial:
    """The prompts prefilled and decoded for up to `stop_at` iterations (None: to the end)
    by the weights of `model`, version `version`."""
    num_prompts = prompt_ids_PxL.shape[0]
    keys_B = row_keys(key, num_prompts, config.num_generations)
    limit_B = row_limits(None, keys_B.shape[0], config.max_new_tokens)
    progress = _begin(model, config, prompt_ids_PxL, prompt_mask_PxL, keys_B, limit_B)
    version_BxC = jnp.where(progress.out.mask_BxC, jnp.int32(version), -1)
    partial = Partial(progress, version_BxC, jax.random.key_data(key), prompt_ids_PxL,
                      prompt_mask_PxL)
    return resume(model, config, partial, version, stop_at)


def resume(model: Transformer, config: SamplerConfig, partial: Partial, version: jax.Array,
           stop_at: jax.Array | None = None) -> Partial:
    """`partial` decoded on by the weights of `model` (version `version`) until every row has
    finished, or `stop_at` decode iterations have run since `start` (on each device)."""
    keys_B = row_keys(jax.random.wrap_key_data(partial.key_bits), partial.prompt_ids_PxL.shape[0],
                      config.num_generations)
    before_BxC = partial.progress.out.mask_BxC
    progress = _advance(model, config, partial, keys_B, stop_at)
    drawn_BxC = progress.out.mask_BxC & ~before_BxC
    return partial.replace(progress=progress, version_BxC=jnp.where(
        drawn_BxC, jnp.int32(version), partial.version_BxC))


def finish(config: SamplerConfig, partial: Partial) -> tuple[Rollout, jax.Array]:
    """(rollout, version_BxC) of a finished `partial` (`Partial.finished`)."""
    rollout = to_rollout(partial.progress.out, partial.prompt_ids_PxL, partial.prompt_mask_PxL,
                         config.num_generations, jnp.sum(partial.progress.slot_steps))
    return rollout, constrain(partial.version_BxC, ("batch", None))


def split_ways(partial: Partial) -> int:
    """How many devices' pieces `partial` holds (1: one piece); arrays or abstract ones."""
    return math.prod(partial.progress.steps.shape)


def _pieces(progress: InProgress) -> InProgress:
    """A device's progress as one piece of the split `Partial`'s: its scalar counts [1]."""
    def one(path, x):
        if x.ndim == 0 and leaf_name(path) not in _SCALARS:
            raise TypeError(f"{leaf_name(path)}: a scalar of the progress that a split Partial "
                            f"does not know (add it to _SCALARS)")
        return x[None] if x.ndim == 0 else x

    return jax.tree_util.tree_map_with_path(one, progress)


def _own(progress: InProgress) -> InProgress:
    """A device's piece of the split progress as `decode_loop.advance` takes it."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x[0] if leaf_name(path) in _SCALARS else x, progress)


def _pack(progress: InProgress):
    """((the pool, every other leaf), their tree): the pool's pieces lie on its page axis,
    the others' on their first (the shard_map specs of the two)."""
    state = progress.state
    leaves, treedef = jax.tree.flatten(progress.replace(state=state.replace(kv_pages=None)))
    return (state.kv_pages, leaves), treedef


def _unpack(packed, treedef) -> InProgress:
    kv_pages, leaves = packed
    progress = jax.tree.unflatten(treedef, leaves)
    return progress.replace(state=progress.state.replace(kv_pages=kv_pages))


def _spec(path, x, mesh: Mesh, rules: AxisRules, axes: tuple[str, ...]) -> P:
    """A leaf's spec: with `axes` (split), the progress's pieces over them (the pool's on
    its page axis, kv heads by the rules); otherwise rows over `batch`, the pool by its kv
    heads; the rest replicated."""
    name = leaf_name(path)
    if axes and getattr(path[0], "name", "") == "progress":
        return pool_spec(mesh, rules, axes, x.shape) if name == "kv_pages" else P(axes)
    if name == "kv_pages":
        return rules.spec(slots.KV_AXES, x.shape, mesh)
    if name.endswith(_ROW_SUFFIXES) and x.ndim:
        return rules.spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh)
    return P()


def partial_shardings(partial: Partial, mesh: Mesh, rules: AxisRules) -> Partial:
    """The shardings of `constrain_partial`'s layout on `mesh` (for abstract arrays too)."""
    axes = row_axes(mesh, rules, partial.version_BxC.shape[0])
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, _spec(p, x, mesh, rules, axes)), partial)


def constrain_partial(partial: Partial) -> Partial:
    """`partial` in its one layout under the active rules (`partial_shardings`); a no-op
    outside `use_rules`."""
    active = active_rules()
    if active is None:
        return partial
    return jax.lax.with_sharding_constraint(partial, partial_shardings(partial, *active))

