"""Host-side helpers for a run that spans several processes (every helper also works, and
does nothing special, in a single process).

    is_main()                    process 0: the one that logs, prints and writes run files
    sync(name)                   every process waits here until all have arrived
    broadcast(obj)               process 0's JSON-able value, on every process
    local_rows(x_BxN)            the leading-axis rows of a global array held by this process
    process_rows(sharding, shape)  the slice of leading-axis rows that is this process's
    from_local_rows(sharding, local, shape)  a global array from every process's own rows

A batch is split over the mesh's batch axes; with the devices ordered process by process
(`jaxrl.sharding.make_mesh`), each process holds one contiguous block of rows. The helpers
check that and fail with the block they found otherwise.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def is_main() -> bool:
    """Whether this is process 0 (the only one that logs and writes run files)."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """A barrier across processes (a no-op in a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def broadcast(obj: Any) -> Any:
    """Process 0's `obj` (JSON-able) on every process."""
    if jax.process_count() == 1:
        return obj
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8) if is_main() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
    padded = np.zeros(size, np.uint8)
    padded[:data.size] = data
    out = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return json.loads(out.tobytes().decode())


def _row_blocks(index_map: dict[jax.Device, tuple[slice, ...]], rows: int, axis: int) -> slice:
    """The one contiguous block of rows (along `axis`) covered by the devices of `index_map`."""
    spans = sorted({index[axis].indices(rows)[:2] for index in index_map.values()})
    start, stop = spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > stop:
            raise ValueError(f"process {jax.process_index()} holds the rows {spans} of a batch of "
                             f"{rows}, not one contiguous block: place the batch axes of the mesh "
                             f"so that each host's devices are adjacent (layout key `hosts`)")
        stop = max(stop, b)
    return slice(start, stop)


def process_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...], axis: int = 0
                 ) -> slice:
    """The rows [start, stop) along `axis` of an array of `shape` on `sharding` that this
    process holds."""
    return _row_blocks(sharding.addressable_devices_indices_map(tuple(shape)), shape[axis], axis)


def local_rows(x: jax.Array, axis: int = 0) -> np.ndarray:
    """This process's rows of `x` along `axis`, as one numpy array, in row order."""
    if x.is_fully_addressable:
        return np.asarray(x)
    rows = process_rows(x.sharding, x.shape, axis)
    shape = list(x.shape)
    shape[axis] = rows.stop - rows.start
    out = np.empty(shape, x.dtype)
    for shard in x.addressable_shards:
        index = list(shard.index)
        start, stop = index[axis].indices(x.shape[axis])[:2]
        index[axis] = slice(start - rows.start, stop - rows.start)
        out[tuple(index)] = np.asarray(shard.data)
    return out


def from_local_rows(sharding: jax.sharding.Sharding, local: np.ndarray,
                    shape: tuple[int, ...], axis: int = 0) -> jax.Array:
    """The global array of `shape` on `sharding` whose rows along `axis`
    (`process_rows(sharding, shape, axis)`) are this process's `local`: every process
    passes its own."""
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    rows = process_rows(sharding, shape, axis)
    expected = list(shape)
    expected[axis] = rows.stop - rows.start
    if local.shape != tuple(expected):
        raise ValueError(f"process {jax.process_index()} holds rows {rows.start}..{rows.stop - 1} "
                         f"(axis {axis}) of {shape}, but got local data of shape {local.shape}")
    return jax.make_array_from_process_local_data(sharding, local, shape)
