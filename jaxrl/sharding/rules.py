"""Logical axis names, the rules that map them onto mesh axes, and activation constraints.

Model code names *logical* axes only (`embed`, `heads`, `batch`, ...). A rule set maps each
logical axis to zero or more mesh axes (`data`, `fsdp`, `tensor`). Training and rollout use
different rule sets over the same mesh: training shards weights over fsdp and tensor, rollout
keeps weights on tensor only so decoding never all-gathers them per token.

A dimension that a rule's mesh axes do not divide evenly is replicated over those axes
instead (e.g. 2 kv heads on a 4-way tensor axis), and a mesh axis is used at most once per
array (the first dimension that asks for it gets it), so every rule set works on every mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axes of parameters.
# `qkv` and `gate_up` index the parts of a fused projection (q heads / key / value; gate /
# up): HF stores each part as a tensor of its own. No preset shards them. `expert` indexes the
# experts of a mixture-of-experts layer (`jaxrl.models.moe`): expert parallelism maps it to
# a mesh axis (the `fsdp_ep` preset).
PARAM_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "qkv",
              "gate_up", "expert")
# Logical axes of activations and of the KV cache.
ACTIVATION_AXES = ("batch", "seq", "act_embed", "act_heads", "act_kv_heads", "act_mlp",
                   "act_vocab", "cache_seq")
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

LogicalAxes = Sequence[str | None]


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Maps logical axis names to tuples of mesh axis names (empty tuple: replicated)."""

    rules: tuple[tuple[str, tuple[str, ...]], ...]

    def __post_init__(self):
        for logical, mesh_axes in self.rules:
            if logical not in LOGICAL_AXES:
                raise ValueError(
                    f"unknown logical axis {logical!r} in sharding rules; "
                    f"expected one of: {', '.join(LOGICAL_AXES)}"
                )
            for axis in mesh_axes:
                if axis not in MESH_AXES:
                    raise ValueError(
                        f"rule {logical!r} names mesh axis {axis!r}; "
                        f"expected one of: {', '.join(MESH_AXES)}"
                    )

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str | Sequence[str] | None]) -> AxisRules:
        """From `{logical: mesh axis | [mesh axes] | None}`, as written in a layout YAML."""
        items = []
        for logical, mesh_axes in mapping.items():
            if mesh_axes is None:
                mesh_axes = ()
            elif not isinstance(mesh_axes, (list, tuple)):
                # A single name; anything else but a string fails validation by name.
                mesh_axes = (mesh_axes,)
            items.append((logical, tuple(mesh_axes)))
        return cls(tuple(items))

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes `logical` maps to (empty: replicated)."""
        if logical is None:
            return ()
        if logical not in LOGICAL_AXES:
            # A typo in model code would otherwise silently replicate the array.
            raise ValueError(f"unknown logical axis {logical!r}; expected one of: "
                             f"{', '.join(LOGICAL_AXES)}")
        for name, mesh_axes in self.rules:
            if name == logical:
                return mesh_axes
        return ()

    def without(self, mesh_axes: Sequence[str]) -> AxisRules:
        """These rules with `mesh_axes` mapped to nothing: the rules inside a `shard_map`
        that made those axes manual (each device then holds its own share of them)."""
        return AxisRules(tuple((logical, tuple(a for a in axes if a not in mesh_axes))
                               for logical, axes in self.rules))

    def size(self, logical: str, mesh: Mesh) -> int:
        """How many ways `logical` is split on `mesh` (1: replicated)."""
        return math.prod(mesh.shape.get(a, 1) for a in self.mesh_axes(logical))

    def spec(self, logical_axes: LogicalAxes, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
        """PartitionSpec for an array of `shape` whose dimensions carry `logical_axes`."""
        if len(logical_axes) != len(shape):
            raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
        used: set[str] = set()
        entries: list[str | tuple[str, ...] | None] = []
        for logical, size in zip(logical_axes, shape, strict=True):
            axes = tuple(a for a in self.mesh_axes(logical)
                         if a not in used and mesh.shape.get(a, 1) > 1)
            # Drop trailing mesh axes until they divide the dimension evenly.
            while axes and size % math.prod(mesh.shape[a] for a in axes):
                axes = axes[:-1]
            used.update(axes)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def sharding(self, logical_axes: LogicalAxes, shape: Sequence[int], mesh: Mesh) -> NamedSharding:
        """`spec` as a NamedSharding on `mesh`."""
        return NamedSharding(mesh, self.spec(logical_axes, shape, mesh))


def variable_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axes a parameter was created with (replicated if it has none)."""
    axes = variable.get_metadata().get("out_sharding")
    return tuple(axes) if axes is not None else (None,) * len(variable.shape)


def state_shardings(state: nnx.State, mesh: Mesh, rules: AxisRules) -> nnx.State:
    """A State of NamedShardings with the structure of `state` (abstract or concrete)."""
    def one(variable: nnx.Variable) -> nnx.Variable:
        return variable.replace(rules.sharding(variable_axes(variable), variable.shape, mesh))
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


# ------------------------------------------------------------------ activation constraints

_ACTIVE: contextvars.ContextVar[tuple[Mesh, AxisRules] | None] = contextvars.ContextVar(
    "jaxrl_axis_rules", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: AxisRules) -> Iterator[None]:
    """Within this context `constrain` pins activations to `rules` on `mesh`.

    It acts at trace time: enter it *inside* the jitted function. A function traced outside
    the context and called inside it reuses its cached trace, without constraints.
    """
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[Mesh, AxisRules] | None:
    """The (mesh, rules) of the innermost `use_rules`, or None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """`with_sharding_constraint` by logical axes; a no-op outside `use_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, rules.sharding(logical_axes, x.shape, mesh))
