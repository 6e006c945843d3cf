"""One set of devices split in two: a rollout side and a train side (the asynchronous mode).

    rollout, train = split_devices(4, jax.devices())        # 8 devices: 4 and 4
    rollout_mesh = make_mesh(rollout_layout, rollout)
    train_mesh = make_mesh(train_layout, train)

`rollout_devices` is a count (an int >= 1) or a fraction of all devices (a float in (0, 1),
rounded down); either way both sides keep at least one device. Each process gives the same
share of its own devices to the rollout side (its lowest ids), so with several processes
both meshes span every process and each process feeds its own rows to both, as it does to
the one mesh of the synchronous modes; the count must then divide by the process count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax

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
