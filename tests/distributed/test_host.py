"""Host-side row helpers on one process (8 CPU devices), and the process-major mesh that
gives each process one contiguous block of rows."""

import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.distributed import broadcast, from_local_rows, local_rows, process_rows
from jaxrl.sharding.layout import LayoutError, load_layout, make_mesh


def _mesh():
    return make_mesh(load_layout("dp_fsdp_tp"))  # data 2 x fsdp 2 x tensor 2


def test_one_process_holds_every_row_and_gets_them_back():
    mesh = _mesh()
    x_BxN = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    np.testing.assert_array_equal(process_rows(rows, x_BxN.shape), np.arange(8))
    placed = from_local_rows(rows, x_BxN, x_BxN.shape)
    assert placed.sharding == rows
    np.testing.assert_array_equal(local_rows(placed), x_BxN)
    cols = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp")))
    x_KxB = x_BxN.T.copy()
    np.testing.assert_array_equal(local_rows(from_local_rows(cols, x_KxB, x_KxB.shape, axis=1),
                                             axis=1), x_KxB)
    assert broadcast({"a": [1, 2]}) == {"a": [1, 2]}


def test_rows_of_interleaved_shards_are_taken_in_ascending_order():
    """A TPU slice's topology order can give one host shards 4-5 and 0-1 of a batch of 8:
    its local data is rows 0, 1, 4, 5 (the layout make_array_from_process_local_data reads)."""
    devices = jax.devices()[:2]
    sharding = types.SimpleNamespace(addressable_devices_indices_map=lambda shape: {
        devices[0]: (slice(4, 6), slice(None)), devices[1]: (slice(0, 2), slice(None))})
    np.testing.assert_array_equal(process_rows(sharding, (8, 3)), [0, 1, 4, 5])


def _fake_devices(processes: int, per_process: int):
    return [types.SimpleNamespace(id=i, process_index=i // per_process, platform="gpu")
            for i in range(processes * per_process)]


@pytest.mark.parametrize("layout, processes, per_process, want", [
    # dp_fsdp_tp, data spans hosts: each host one data row of fsdp x tensor = 2 x 2.
    ("dp_fsdp_tp", 2, 4, {"data": 2, "fsdp": 2, "tensor": 2}),
    # fsdp spans hosts: host 0 holds fsdp 0..3, host 1 fsdp 4..7.
    ("fsdp", 2, 4, {"data": 1, "fsdp": 8, "tensor": 1}),
    # fsdp_tp: tensor pairs within a host, fsdp across.
    ("fsdp_tp", 4, 2, {"data": 1, "fsdp": 4, "tensor": 2}),
])
def test_each_process_gets_a_contiguous_block_of_the_hosts_axis(layout, processes,
                                                               per_process, want):
    from jaxrl.sharding.layout import _process_major_grid

    layout = load_layout(layout)
    devices = _fake_devices(processes, per_process)[::-1]  # order must not matter
    shape = layout.mesh_shape(len(devices))
    assert shape == want
    grid = _process_major_grid(layout, devices, shape, processes)
    assert grid.shape == tuple(want.values())
    owner = np.vectorize(lambda d: d.process_index)(grid)
    hosts_axis = ("data", "fsdp", "tensor").index(layout.hosts)
    # Along the other axes one process; along the hosts axis processes in order, in blocks.
    moved = np.moveaxis(owner, hosts_axis, 0).reshape(shape[layout.hosts], -1)
    assert (moved == moved[:, :1]).all()
    assert list(moved[:, 0]) == sorted(moved[:, 0])
    assert set(moved[:, 0]) == set(range(processes))


def test_a_mesh_that_cuts_processes_apart_is_refused():
    from jaxrl.sharding.layout import _process_major_grid

    layout = load_layout("dp_fsdp_tp")  # fsdp x tensor = 4 devices within a host
    devices = _fake_devices(4, 3)  # 12 devices, 3 per process: 4 does not fit in 3
    shape = layout.mesh_shape(len(devices))
    with pytest.raises(LayoutError, match="does not split into the 4 processes of 3 devices"):
        _process_major_grid(layout, devices, shape, 4)


def test_hosts_must_name_a_mesh_axis(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("mesh: {data: 1, fsdp: -1, tensor: 1}\nhosts: pipeline\n")
    with pytest.raises(LayoutError, match="hosts must name a mesh axis .* got 'pipeline'"):
        load_layout(path)
    assert len(jax.devices()) == 8
