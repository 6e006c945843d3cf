"""One set of devices split in two: a rollout side and a train side (the asynchronous mode).

    rollout, train = split_devices(4, jax.devices())        # 8 devices: 4 and 4
    rollout_mesh = make_mesh(rollout_layout, rollout)
    train_mesh = make_mesh(train_layout, train)

`rollout_devices` is a count (an int >= 1) or a fraction of all devices (a float in (0, 1),
rounded down); either way both sides keep at least one device. Each process gives the same
share of its own devices to the rollout side (its lowest ids), so with several processes
both meshes span every process and each process feeds its own rows to both, as it does to
the one mesh of the synchronous modes; the count must then divide by the process count.

    params_on_rollout = move(params, rollout_shardings)      # a tree, train mesh -> rollout

`move` copies arrays from one sub-mesh to the other. In one process that is `jax.device_put`.
Over several processes JAX refuses a reshard between different device sets (multi-controller
JAX supports it only on TPU runtimes), but none is needed: the split keeps each process's
part of an array on its own devices on both sides (the same rows, the same parameter
shards, for layouts that split them alike), so each process copies its own shards from its
train devices to its rollout devices and the global array is assembled from them
(`jax.make_array_from_single_device_arrays`). Where the two sides split an array differently
(the rollout rules replicate what training shards), the array is first resharded on the train
mesh to the rollout side's split, which for meshes of the same shape puts the same parts in
each process; meshes of different shapes over several processes are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxrl.sharding.layout import LayoutError


def rollout_device_count(rollout_devices: int | float, total: int) -> int:
    """The number of rollout devices out of `total` that `rollout_devices` asks for."""
    if isinstance(rollout_devices, bool) or not isinstance(rollout_devices, int | float):
        raise LayoutError(f"sharding.rollout_devices must be a device count (an int) or a "
                          f"fraction of the devices (a float in (0, 1)), got "
                          f"{rollout_devices!r}")
    if isinstance(rollout_devices, float):
        if not 0 < rollout_devices < 1:
            raise LayoutError(f"sharding.rollout_devices as a fraction must be in (0, 1), got "
                              f"{rollout_devices}")
        count = math.floor(rollout_devices * total)
    else:
        count = rollout_devices
    if not 1 <= count <= total - 1:
        raise LayoutError(f"sharding.rollout_devices={rollout_devices!r} gives {count} rollout "
                          f"device(s) of {total}: each side needs at least one (1 to "
                          f"{total - 1} here)")
    return count


def split_devices(rollout_devices: int | float, devices: Sequence[jax.Device] | None = None,
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
    """(rollout devices, train devices): disjoint, together all of `devices` (default: all)."""
    devices = sorted(jax.devices() if devices is None else devices,
                     key=lambda d: (d.process_index, d.id))
    count = rollout_device_count(rollout_devices, len(devices))
    by_process: dict[int, list[jax.Device]] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    processes = len(by_process)
    if count % processes:
        raise LayoutError(f"sharding.rollout_devices={rollout_devices!r} gives {count} rollout "
                          f"devices, which {processes} processes cannot share evenly (each "
                          f"gives the same number of its own devices); use a multiple of "
                          f"{processes}")
    share = count // processes
    if any(len(local) <= share for local in by_process.values()):
        raise LayoutError(f"sharding.rollout_devices={rollout_devices!r} takes {share} devices "
                          f"of each process, leaving a process with none for training")
    rollout = [d for local in by_process.values() for d in local[:share]]
    train = [d for local in by_process.values() for d in local[share:]]
    return rollout, train


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index as hashable (start, stop) pairs."""
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=False))


def move_array(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """`x` with `sharding` on the other sub-mesh (module docstring)."""
    if jax.process_count() == 1 or not isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    source = getattr(x, "sharding", None)
    if (not x.is_fully_addressable and isinstance(source, NamedSharding)
            and isinstance(sharding, NamedSharding) and source.spec != sharding.spec
            and source.mesh.shape == sharding.mesh.shape):
        # First the target's split on the source's own devices (a reshard JAX does across
        # processes): a mesh of the same shape then holds the same parts in each process.
        x = jax.device_put(x, NamedSharding(source.mesh, sharding.spec))
    held = {} if x.is_fully_addressable else {_key(s.index, x.shape): s.data
                                              for s in x.addressable_shards}
    shards = []
    for device, index in sharding.addressable_devices_indices_map(x.shape).items():
        # A process-local value (the same in every process) has every part.
        data = x[index] if x.is_fully_addressable else held.get(_key(index, x.shape))
        if data is None:
            raise LayoutError(
                f"process {jax.process_index()} needs the part {_key(index, x.shape)} of an "
                f"array of shape {x.shape} on {device}, which another process holds: over "
                f"several processes the rollout and train meshes must have the same shape "
                f"(sharding.rollout_layout like sharding.layout, as many rollout as train "
                f"devices)")
        shards.append(jax.device_put(data, device))
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def move(tree: Any, shardings: Any) -> Any:
    """Every array of `tree` with the matching sharding of `shardings` (`move_array`)."""
    return jax.tree.map(move_array, tree, shardings)
