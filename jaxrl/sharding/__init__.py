"""Meshes, logical-axis rules and sharded state creation."""

from jaxrl.sharding.create import create_sharded, reshard
from jaxrl.sharding.layout import (
    Layout,
    available_presets,
    load_layout,
    make_mesh,
    resolve_layout,
)
from jaxrl.sharding.rules import (
    LOGICAL_AXES,
    MESH_AXES,
    AxisRules,
    constrain,
    state_shardings,
    use_rules,
)

__all__ = [
    "LOGICAL_AXES", "MESH_AXES", "AxisRules", "Layout", "available_presets", "constrain",
    "create_sharded", "load_layout", "make_mesh", "resolve_layout", "reshard", "state_shardings", "use_rules",
]
