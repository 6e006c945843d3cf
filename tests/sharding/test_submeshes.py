"""Rollout and train devices: counts, fractions, several processes, bad values; a policy
moved from a train mesh to a rollout mesh on the other devices."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Transformer
from jaxrl.sharding import load_layout, make_mesh, state_shardings
from jaxrl.sharding.layout import LayoutError
from jaxrl.sharding.submeshes import rollout_device_count, split_devices
from tests.conftest import make_tiny_config


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


@pytest.mark.parametrize("spec,total,expected", [
    (4, 8, 4), (1, 8, 1), (7, 8, 7), (0.5, 8, 4), (0.25, 8, 2), (0.3, 8, 2), (0.9, 8, 7),
])
def test_rollout_device_count(spec, total, expected):
    assert rollout_device_count(spec, total) == expected


@pytest.mark.parametrize("spec,match", [
    (0, r"gives 0 rollout device\(s\) of 8"), (8, "gives 8 rollout"), (0.1, "gives 0 rollout"),
    (1.0, r"fraction must be in \(0, 1\), got 1.0"), (-0.5, "fraction"), (True, "got True"),
    ("4", "got '4'"),
])
def test_bad_rollout_devices_are_named(spec, match):
    with pytest.raises(LayoutError, match=match):
        rollout_device_count(spec, 8)


def test_split_takes_the_lowest_ids_and_keeps_every_device():
    rollout, train = split_devices(3)
    assert [d.id for d in rollout] == [0, 1, 2]
    assert [d.id for d in train] == [3, 4, 5, 6, 7]


def test_each_process_gives_the_same_share():
    devices = [FakeDevice(i, i // 4) for i in reversed(range(8))]  # 2 processes x 4
    rollout, train = split_devices(2, devices)
    assert [(d.process_index, d.id) for d in rollout] == [(0, 0), (1, 4)]
    assert [(d.process_index, d.id) for d in train] == [(0, 1), (0, 2), (0, 3), (1, 5), (1, 6),
                                                         (1, 7)]
    with pytest.raises(LayoutError, match="2 processes cannot share evenly.*multiple of 2"):
        split_devices(3, devices)
    with pytest.raises(LayoutError, match="leaving a process with none"):
        split_devices(2, [FakeDevice(0, 0)] + [FakeDevice(i, 1) for i in range(1, 8)])


def test_a_policy_moves_from_the_train_mesh_to_the_rollout_mesh():
    rollout_devices, train_devices = split_devices(4)
    layout = load_layout("fsdp")
    train_mesh = make_mesh(layout, train_devices)
    rollout_mesh = make_mesh(load_layout("fsdp_tp"), rollout_devices)
    model = Transformer(make_tiny_config("llama"), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    on_train = jax.device_put(params, state_shardings(params, train_mesh, layout.train_rules))
    target = state_shardings(params, rollout_mesh, load_layout("fsdp_tp").rollout_rules)
    on_rollout = jax.device_put(on_train, target)
    for moved, want, sharding in zip(jax.tree.leaves(on_rollout), jax.tree.leaves(params),
                                     jax.tree.leaves(target), strict=True):
        assert moved.sharding == sharding
        assert {d.id for d in moved.sharding.device_set} <= {0, 1, 2, 3}
        np.testing.assert_array_equal(np.asarray(moved), np.asarray(want))
