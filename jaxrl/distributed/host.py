"""Host-side helpers for a run that spans several processes (every helper also works, and
does nothing special, in a single process).

    is_main()                    process 0: the one that logs, prints and writes run files
    sync(name)                   every process waits here until all have arrived
    wait_for_all(name)           the same without a collective, for a far apart arrival
    broadcast(obj)               process 0's JSON-able value, on every process
    is_lost_peer(e)              whether an error is a collective's whose peer went away
    local_rows(x_BxN)            the leading-axis rows of a global array held by this process
    process_rows(sharding, shape)  the row indices this process's devices hold
    from_local_rows(sharding, local, shape)  a global array from every process's own rows

A batch is split over the mesh's batch axes; a process holds the rows of its devices' shards.
With the devices ordered process by process (`jaxrl.sharding.make_mesh` on GPU and CPU) they
are one contiguous block; a TPU slice's topology order may interleave hosts, and then they
are several blocks, taken in ascending order (as `make_array_from_process_local_data` lays
out local data).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from orbax.checkpoint import multihost


def is_main() -> bool:
    """Whether this is process 0 (the only one that logs and writes run files)."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """A barrier across processes (a no-op in a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def wait_for_all(name: str, timeout_s: float = 3600.0) -> None:
    """Every process waits here until all have arrived, through the coordination service:
    no collective, unlike `sync`, so nothing to compile and no gloo rendezvous (which gives
    up after 30 s). For a point one process may reach minutes after another: on CPU only
    process 0 reads programs from the persistent compilation cache (docs/testing.md, "The
    compilation cache"), the others compile them. A no-op in a single process; a process
    that died ends the wait with the coordination service's error."""
    if jax.process_count() > 1:
        multihost.get_barrier_sync_fn()(key=name, timeout_ms=int(timeout_s * 1000))


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


def is_lost_peer(e: BaseException) -> bool:
    """Whether `e` is a collective's error because another process went away (gloo, NCCL and
    the coordination service say so in these words)."""
    return isinstance(e, jax.errors.JaxRuntimeError) and any(
        words in str(e) for words in ("Connection closed by peer", "Connection reset",
                                      "UNAVAILABLE", "DEADLINE_EXCEEDED", "unhealthy"))


def process_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...], axis: int = 0
                 ) -> np.ndarray:
    """The indices along `axis` of the rows of an array of `shape` on `sharding` that this
    process's devices hold, ascending: the order of its local data."""
    n = shape[axis]
    spans = sorted({index[axis].indices(n)[:2]
                    for index in sharding.addressable_devices_indices_map(tuple(shape)).values()})
    return np.concatenate([np.arange(a, b) for a, b in spans])


def local_rows(x: jax.Array, axis: int = 0) -> np.ndarray:
    """This process's rows of `x` along `axis` (`process_rows`), as one numpy array."""
    if x.is_fully_addressable:
        return np.asarray(x)
    rows = process_rows(x.sharding, x.shape, axis)
    slot = {int(r): i for i, r in enumerate(rows)}
    shape = list(x.shape)
    shape[axis] = len(rows)
    out = np.empty(shape, x.dtype)
    for shard in x.addressable_shards:
        index = list(shard.index)
        start, stop = index[axis].indices(x.shape[axis])[:2]
        index[axis] = slice(slot[start], slot[start] + stop - start)
        out[tuple(index)] = np.asarray(shard.data)
    return out


def from_local_rows(sharding: jax.sharding.Sharding, local: np.ndarray,
                    shape: tuple[int, ...], axis: int = 0) -> jax.Array:
    """The global array of `shape` on `sharding` whose rows `process_rows(sharding, shape,
    axis)` are this process's `local` (every process passes its own)."""
    expected = list(shape)
    expected[axis] = len(process_rows(sharding, shape, axis))
    if local.shape != tuple(expected):
        raise ValueError(f"process {jax.process_index()} holds {expected[axis]} of the "
                         f"{shape[axis]} rows (axis {axis}) of {tuple(shape)}, but got local data "
                         f"of shape {local.shape}")
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local, shape)
