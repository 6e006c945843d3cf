"""Layouts: a mesh shape plus a training and a rollout rule set, read from `sharding/*.yaml`.

A layout file looks like

    mesh: {data: 1, fsdp: -1, tensor: 2}   # per slice; -1 takes the remaining devices
    dcn: {data: 1}                          # slices (TPU multislice): multiplies the data axis
    rules:
      train:   {batch: [data, fsdp], embed: fsdp, mlp: tensor, ...}
      rollout: {batch: [data, fsdp], mlp: tensor, ...}

and is validated against the schema below by OmegaConf (unknown keys and wrong types fail
with the key named). `make_mesh` is the one place where jaxrl creates a device mesh.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxrl.sharding.rules import MESH_AXES, AxisRules

PRESET_DIR_ENV = "JAXRL_SHARDING_DIR"


class LayoutError(ValueError):
    """A layout that is malformed or does not fit the devices."""


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    data: int = 1
    fsdp: int = -1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class DcnAxes:
    data: int = 1


@dataclasses.dataclass(frozen=True)
class RuleSets:
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    rollout: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """The schema of a layout YAML file."""

    mesh: MeshAxes = dataclasses.field(default_factory=MeshAxes)
    dcn: DcnAxes = dataclasses.field(default_factory=DcnAxes)
    rules: RuleSets = dataclasses.field(default_factory=RuleSets)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A resolved layout: mesh shape per slice, slice count and both rule sets."""

    name: str
    mesh: MeshAxes
    dcn_data: int
    train_rules: AxisRules
    rollout_rules: AxisRules

    def __post_init__(self):
        sizes = dataclasses.asdict(self.mesh)
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise LayoutError(f"layout {self.name!r}: mesh.{axis} must be -1 or >= 1, got {size}")
        if list(sizes.values()).count(-1) > 1:
            raise LayoutError(f"layout {self.name!r}: at most one mesh axis may be -1, got {sizes}")
        if self.dcn_data < 1:
            raise LayoutError(f"layout {self.name!r}: dcn.data must be >= 1, got {self.dcn_data}")

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        """Global mesh shape for `num_devices` (the data axis includes the dcn factor)."""
        sizes = dataclasses.asdict(self.mesh)
        fixed = math.prod(s for s in sizes.values() if s != -1) * self.dcn_data
        shown = ", ".join(f"{a}={s}" for a, s in sizes.items()) + f", dcn data={self.dcn_data}"
        if -1 in sizes.values():
            if num_devices % fixed:
                raise LayoutError(
                    f"layout {self.name!r} ({shown}) needs a multiple of {fixed} devices, "
                    f"but {num_devices} are available")
            sizes = {a: num_devices // fixed if s == -1 else s for a, s in sizes.items()}
        elif fixed != num_devices:
            raise LayoutError(
                f"layout {self.name!r} ({shown}) needs {fixed} devices (the product of its "
                f"axes), but {num_devices} are available")
        sizes["data"] *= self.dcn_data
        return sizes


def preset_dir() -> Path:
    """Where named presets live: $JAXRL_SHARDING_DIR, else the installed presets, else the
    repository's top-level `sharding/`.

    A wheel ships the repository's `sharding/*.yaml` as `jaxrl/sharding/presets/` (see
    pyproject.toml); a source checkout or an editable install reads `sharding/` in place.
    """
    env = os.environ.get(PRESET_DIR_ENV)
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    installed = here / "presets"
    return installed if installed.is_dir() else here.parents[1] / "sharding"


def available_presets() -> list[str]:
    directory = preset_dir()
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


def load_layout(name_or_path: str | os.PathLike) -> Layout:
    """Reads a preset by name (`fsdp_tp`) or a layout YAML by path."""
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith((".yaml", ".yml")) or os.sep in text):
        path = preset_dir() / f"{text}.yaml"
        if not path.is_file():
            raise FileNotFoundError(
                f"unknown sharding layout {text!r}; presets in {preset_dir()}: "
                f"{', '.join(available_presets()) or '(none found)'}; or give a path to a YAML file"
            )
    if not path.is_file():
        raise FileNotFoundError(f"sharding layout file {str(path)!r} does not exist")
    try:
        spec = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(LayoutSpec), OmegaConf.load(path)))
    except OmegaConfBaseException as e:
        raise LayoutError(f"invalid sharding layout {str(path)!r}: {e}") from None
    rule_sets = {}
    for which in ("train", "rollout"):
        try:
            rule_sets[which] = AxisRules.from_mapping(getattr(spec.rules, which))
        except ValueError as e:
            raise LayoutError(f"invalid sharding layout {str(path)!r}: rules.{which}: {e}") from None
    return Layout(
        name=path.stem,
        mesh=spec.mesh,
        dcn_data=spec.dcn.data,
        train_rules=rule_sets["train"],
        rollout_rules=rule_sets["rollout"],
    )


def make_mesh(layout: Layout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The device mesh (axes data, fsdp, tensor) for `layout` over `devices` (default: all).

    Axes are `Auto` (GSPMD): shardings come from the rules, and XLA propagates the rest.
    With `dcn.data > 1` the data axis spans slices and fsdp/tensor stay inside one slice,
    so the fast interconnect carries the weight traffic.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = layout.mesh_shape(len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    sizes = tuple(shape[a] for a in MESH_AXES)
    if layout.dcn_data > 1:
        if not hasattr(devices[0], "slice_index"):
            # Only TPU multislice devices carry a slice index; elsewhere there is one slice.
            raise LayoutError(
                f"layout {layout.name!r} asks for dcn.data={layout.dcn_data} slices, but the "
                f"{devices[0].platform} devices report no slices (no slice_index); set dcn.data "
                f"to 1 and span hosts with mesh.data instead")
        ici = (shape["data"] // layout.dcn_data, shape["fsdp"], shape["tensor"])
        grid = mesh_utils.create_hybrid_device_mesh(ici, (layout.dcn_data, 1, 1), devices)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)
    try:
        return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        # Device-topology-aware placement is unavailable for this set (e.g. a subset of
        # devices); a plain row-major grid is still a correct mesh.
        return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=axis_types)
