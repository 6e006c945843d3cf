"""Host-driven slots split over a mesh: the pool of a server and of the multi-turn loop.

    split       = SlotSplit.over(mesh, rules, num_slots)   D: the devices that split the slots
    state       = split.init(model_config, layout)         layout: ONE device's pool, of
                                                           split.local_slots = S / D slots
    state       = split.on_owner(fn, state, slot, *args)   fn(state, local slot, *args) -> state,
                                                           run by the device holding `slot` only
    state, out  = split.on_each(fn, state, *args)          fn(state, *args) -> (state, out_S),
                                                           every device on its own slots

The drivers (`jaxrl.serve.engine`, `jaxrl.step.multiturn_rollout`) give the engine's ops
(`jaxrl.rollout.slots`) as `fn`, with the policy's weights in `args`: a device's ops are the
engine's ops on one pool, its own.

Which devices. The slots split over the rollout rules' batch axes (data x fsdp), trailing
axes dropped until their product D divides the slots (the RL driver's rule for rows,
`decode_loop.row_axes`). When none divides (3 slots on 4 devices), the state is one pool that
every device holds (GSPMD replicates it, as before the split), and `D` is 1. KV heads split
over `tensor` either way, as the model's attention reads them.

The global state is the D devices' states side by side: device d holds slots
[d S/D, (d+1) S/D) of every per-slot array, pages [d N, (d+1) N) of the pool's page axis (N:
one device's pool) and its own free stack; page ids in a page table or on a free stack are
the device's own (0 .. N-1). Each device's free count is one entry of `FreePages.count`, [D]
here (a scalar in the engine's ops). A slot's tokens do not depend on D (its key is its own);
a device with one slot decodes it with matrix-vector products, which round differently from
two or more (`slot_count.max_concurrent_decodes`: fp32 roundoff in log-probs).

Collectives per decode step (`on_each`): none over the batch axes, which are manual here
(each device decodes its own slots with its own copy of the weights: the shipped rollout
rules keep the weights off those axes; rules that split a weight over them would gather it
at every call). Over `tensor`, the model's own: heads and vocabulary split there, an
all-reduce after attention and after the MLP per layer, and the logits' reductions for
sampling; none carries keys or values (the paged attention gathers each device's own kv
heads' pages: `paged_attention.planes`; tests/rollout/test_slots_on_mesh.py checks the
partitioned HLO). `on_owner` runs `fn` under a
`lax.cond` on the device's index: the other devices skip it (all devices of one tensor group
share that index, so the model's tensor collectives inside run on all of them or none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.rollout import slots
from jaxrl.rollout.decode_loop import row_axes
from jaxrl.rollout.pages import PoolLayout
from jaxrl.sharding import AxisRules, use_rules


@dataclasses.dataclass(frozen=True)
class SlotSplit:
    """`num_slots` slots over the devices of mesh `axes` (none: one pool; no mesh: one
    device). Hashable: a static argument of the drivers' jitted ops."""

    num_slots: int
    mesh: Mesh | None = None
    rules: AxisRules | None = None
    axes: tuple[str, ...] = ()

    @classmethod
    def over(cls, mesh: Mesh | None, rules: AxisRules | None, num_slots: int) -> SlotSplit:
        """The split of the module docstring (`rules`: the rollout rules)."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if (mesh is None) != (rules is None):
            raise ValueError("pass both mesh and rules (the rollout rule set), or neither")
        if mesh is None:
            return cls(num_slots)
        return cls(num_slots, mesh, rules, row_axes(mesh, rules, num_slots))

    @property
    def devices(self) -> int:
        """D: the devices the slots are split over (1: one pool)."""
        return math.prod(self.mesh.shape[a] for a in self.axes) if self.axes else 1

    @property
    def local_slots(self) -> int:
        """The slots each device holds."""
        return self.num_slots // self.devices

    def describe(self) -> str:
        """How the slots are laid out, for a log line."""
        if self.axes:
            return (f"{self.local_slots} per device over {' x '.join(self.axes)} "
                    f"({self.devices} devices)")
        batch = batch_devices(self.mesh, self.rules) if self.mesh is not None else 1
        if batch > 1:
            return (f"one pool on every device: {self.num_slots} slots do not split over the "
                    f"{batch} devices of the batch axes")
        return "one pool"

    def fill_order(self) -> list[int]:
        """The slots in the order a host fills them: one per device in turn, so rows spread
        over the devices while fewer rows than slots run."""
        s = self.local_slots
        return [d * s + i for i in range(s) for d in range(self.devices)]

    def use_rules(self):
        """The rules' context (nothing without a mesh): for replicated work, such as one
        request's prefill, that every device computes."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return use_rules(self.mesh, self.rules)

    # -- the ops ------------------------------------------------------------------------------

    def init(self, model_config, layout: PoolLayout) -> slots.SlotState:
        """Every device's pool empty and its slots free (traced; jit it)."""
        def make():
            return _pieces(slots.init(model_config, layout, self.local_slots))

        if not self.axes:
            with self.use_rules():
                return make()
        return self._shard_map(lambda: self._local(make), (), self._specs(jax.eval_shape(make)))()

    def on_owner(self, fn: Callable, state: slots.SlotState, slot: jax.Array, *args
                 ) -> slots.SlotState:
        """fn(state, local slot, *args) on the device that holds global `slot`; the others
        keep their state (`args` replicated)."""
        slot = jnp.asarray(slot, jnp.int32)
        if not self.axes:
            with self.use_rules():
                return _pieces(fn(_own(state), slot, *args))
        specs = self._specs(state)

        def run(state, slot, *args):
            local = slot - jax.lax.axis_index(self.axes) * self.local_slots
            mine = (local >= 0) & (local < self.local_slots)
            # Everything fn reads enters the cond as an operand: NNX refuses a model merged
            # from values of another trace level (a closure's) inside its own transforms.
            return self._local(lambda: jax.lax.cond(
                mine, lambda s, local, args: _pieces(fn(_own(s), local, *args)),
                lambda s, local, args: s, state, local, args))

        return self._shard_map(run, (specs, P(), *(P(),) * len(args)), specs)(
            state, slot, *args)

    def on_each(self, fn: Callable, state: slots.SlotState, *args
                ) -> tuple[slots.SlotState, object]:
        """fn(state, *args) -> (state, out) on every device over its own slots; each leaf
        of `out` is per slot ([local slots, ...]), concatenated over the devices."""
        if not self.axes:
            with self.use_rules():
                state, out = fn(_own(state), *args)
            return _pieces(state), out
        specs = self._specs(state)

        def run(state, *args):
            state, out = self._local(lambda: fn(_own(state), *args))
            return _pieces(state), out

        return self._shard_map(run, (specs, *(P(),) * len(args)), (specs, P(self.axes)))(
            state, *args)

    # -- layout -------------------------------------------------------------------------------

    def shardings(self, state) -> slots.SlotState | None:
        """The NamedShardings of a (possibly abstract) state on the mesh (None without one):
        slots and pages over the split's axes, the pool's kv heads by the rules."""
        if self.mesh is None:
            return None
        split = self.axes or None

        def one(path, x):
            if leaf_name(path) == "kv_pages":
                return NamedSharding(self.mesh, pool_spec(self.mesh, self.rules, self.axes,
                                                          x.shape))
            return NamedSharding(self.mesh, P(split))

        return jax.tree_util.tree_map_with_path(one, state)

    def _specs(self, state):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: P(None, self.axes) if leaf_name(path) == "kv_pages" else P(self.axes),
            state)

    def _shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(self.axes), check_vma=False)

    def _local(self, fn):
        """fn() inside the shard_map, under the rules less the manual axes."""
        with use_rules(jax.sharding.get_abstract_mesh(), self.rules.without(self.axes)):
            return fn()


def pool_spec(mesh: Mesh, rules: AxisRules, axes: tuple[str, ...], shape) -> P:
    """The PartitionSpec of a pool ([layers, pages, page_size, 2 * kv_heads, head_dim]) whose
    pages are the devices' of `axes` side by side, its kv heads split by the rules."""
    spec = [*rules.spec(slots.KV_AXES, shape, mesh), None, None, None, None, None][:len(shape)]
    spec[1] = axes or None
    return P(*spec)


def batch_devices(mesh: Mesh, rules: AxisRules) -> int:
    """The devices of the rules' batch axes on `mesh`: the most ways slots can split."""
    return math.prod(mesh.shape.get(a, 1) for a in rules.mesh_axes("batch"))


def leaf_name(path) -> str:
    """The field name of a pytree leaf's path ("" for a non-field key)."""
    return getattr(path[-1], "name", "")


def _own(state: slots.SlotState) -> slots.SlotState:
    """A device's piece as the engine's ops take it: its free count a scalar."""
    return state.replace(free=state.free.replace(count=state.free.count[0]))


def _pieces(state: slots.SlotState) -> slots.SlotState:
    """A device's state as one piece of the global state: its free count [1]."""
    return state.replace(free=state.free.replace(count=state.free.count[None]))
