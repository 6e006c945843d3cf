"""Layouts: a mesh shape plus a training and a rollout rule set, read from `sharding/*.yaml`.

A layout file looks like

    mesh: {data: 1, fsdp: -1, tensor: 2}   # per slice; -1 takes the remaining devices
    dcn: {data: 1}                          # slices (TPU multislice): multiplies the data axis
    hosts: fsdp                             # the axis that spans hosts (processes)
    rules:
      train:   {batch: [data, fsdp], embed: fsdp, mlp: tensor, ...}
      rollout: {batch: [data, fsdp], mlp: tensor, ...}

and is validated against the schema below by OmegaConf (unknown keys and wrong types fail
with the key named). `resolve_layout("auto")` picks `single` for one device and `fsdp` for
several. `make_mesh` is the one place where jaxrl creates a device mesh.
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

from jaxrl.config_base import read_yaml
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
    hosts: str = "data"
    rules: RuleSets = dataclasses.field(default_factory=RuleSets)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A resolved layout: mesh shape per slice, slice count and both rule sets."""

    name: str
    mesh: MeshAxes
    dcn_data: int
    train_rules: AxisRules
    rollout_rules: AxisRules
    hosts: str = "data"  # the mesh axis that spans processes (hosts); see make_mesh

    def __post_init__(self):
        if self.hosts not in MESH_AXES:
            raise LayoutError(f"layout {self.name!r}: hosts must name a mesh axis "
                              f"({', '.join(MESH_AXES)}), got {self.hosts!r}")
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
                f"{', '.join(available_presets()) or '(none found)'}; auto (single on one device, "
                f"fsdp on several); or give a path to a YAML file"
            )
    if not path.is_file():
        raise FileNotFoundError(f"sharding layout file {str(path)!r} does not exist")
    try:
        spec = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(LayoutSpec),
                            read_yaml(path, what="sharding layout file")))
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
        hosts=spec.hosts,
        train_rules=rule_sets["train"],
        rollout_rules=rule_sets["rollout"],
    )


AUTO = "auto"


def resolve_layout(name_or_path: str | os.PathLike, num_devices: int | None = None) -> Layout:
    """`load_layout`, where `auto` fits the host: `single` on one device, `fsdp` over several
    (`num_devices`, default: every device of the run)."""
    if str(name_or_path) != AUTO:
        return load_layout(name_or_path)
    count = jax.device_count() if num_devices is None else num_devices
    return load_layout("single" if count == 1 else "fsdp")


def make_mesh(layout: Layout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The device mesh (axes data, fsdp, tensor) for `layout` over `devices` (default: all).

    Axes are `Auto` (GSPMD): shardings come from the rules, and XLA propagates the rest.
    With `dcn.data > 1` the data axis spans slices and fsdp/tensor stay inside one slice,
    so the fast interconnect carries the weight traffic.

    Devices of several processes (GPU clusters, CPU processes): the layout's `hosts` axis
    spans the processes and the other axes run within one, so each process's devices form
    a contiguous block of the mesh (and of every batch split over it), and only the `hosts`
    axis's collectives cross the network. A TPU slice is one interconnect however many
    hosts drive it: `jax.make_mesh` places its axes by the chip topology.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = layout.mesh_shape(len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    sizes = tuple(shape[a] for a in MESH_AXES)
    processes = len({d.process_index for d in devices})
    if processes > 1 and layout.dcn_data == 1 and devices[0].platform != "tpu":
        return Mesh(_process_major_grid(layout, devices, shape, processes), MESH_AXES,
                    axis_types=axis_types)
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


def _process_major_grid(layout: Layout, devices: list[jax.Device], shape: dict[str, int],
                        processes: int) -> np.ndarray:
    """Devices ordered process by process, the `hosts` axis outermost, then moved to its
    place among (data, fsdp, tensor): the other axes stay within a process."""
    hosts = layout.hosts
    within = math.prod(shape[a] for a in MESH_AXES if a != hosts)
    local = len(devices) // processes
    # Each process must fill whole rows of the hosts axis (a host's devices), or whole
    # blocks of the other axes (one process per GPU: a node's processes share a block).
    if shape[hosts] % processes and within % local:
        raise LayoutError(
            f"layout {layout.name!r}: the mesh {shape} does not split into the {processes} "
            f"processes of {local} devices each: the hosts axis {hosts!r} ({shape[hosts]}) is "
            f"not a multiple of {processes} and the other axes ({within} devices) are not a "
            f"multiple of {local}; change the mesh sizes or `hosts`")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    order = [hosts, *(a for a in MESH_AXES if a != hosts)]
    grid = np.asarray(ordered, dtype=object).reshape([shape[a] for a in order])
    return np.moveaxis(grid, 0, MESH_AXES.index(hosts))
