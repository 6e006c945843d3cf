"""Host-driven slots split over the mesh (`jaxrl.rollout.slots_on_mesh`): which devices split
them, each device's share of the pool, an insert that changes its slot's device only, and a
decode step with no collective over the batch axes. (That the tokens are those of one device:
tests/rollout/test_golden.py, served requests and episodes on a mesh.)"""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.rollout import serving, slots
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.slots_on_mesh import SlotSplit
from tests.rollout.test_golden import PROMPTS, _mesh, _model, _on_mesh

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
               "reduce-scatter", "collective-broadcast")


def test_the_batch_axes_that_divide_the_slots_split_them():
    mesh, rules = _mesh("dp_fsdp_tp")  # data 2 x fsdp 2 x tensor 2
    assert SlotSplit.over(mesh, rules, 12).axes == ("data", "fsdp")
    six = SlotSplit.over(mesh, rules, 6)  # 4 does not divide 6: data alone does
    assert (six.axes, six.devices, six.local_slots) == (("data",), 2, 3)
    assert six.fill_order() == [0, 3, 1, 4, 2, 5]  # one device after the other
    three = SlotSplit.over(*_mesh("fsdp"), 3)
    assert (three.axes, three.devices, three.local_slots) == ((), 1, 3)
    assert three.describe() == ("one pool on every device: 3 slots do not split over the 8 "
                                "devices of the batch axes")
    assert SlotSplit.over(None, None, 3) == SlotSplit(3)
    with pytest.raises(ValueError, match="num_slots must be >= 1, got 0"):
        SlotSplit.over(mesh, rules, 0)
    with pytest.raises(ValueError, match="pass both mesh and rules"):
        SlotSplit.over(mesh, None, 4)


def _server(layout, num_slots):
    """(split, graphdef, weights, pool, init, insert, generate): a server's ops, unjitted."""
    model = _model("qwen2")
    split, graphdef, weights = _on_mesh(model, layout, num_slots)
    pool = serving.pool_layout(split.local_slots, max_prefill_length=8, max_new_tokens=9,
                               page_size=4)
    stops, sampling = slots.Stops(), SamplingParams(1.0)

    def init():
        return split.init(model.config, pool)

    def prefill(weights, ids_L, n):
        with split.use_rules():
            return serving.prefill_request(nnx.merge(graphdef, weights), ids_L, n,
                                           jax.random.key(0), sampling, 9)

    def insert(state, prefix, slot):
        return split.on_owner(lambda state, slot, prefix: serving.insert_request(
            state, prefix, slot, pool, stops), state, slot, prefix)

    def generate(weights, state):
        return split.on_each(lambda state, weights: serving.emit_and_generate(
            nnx.merge(graphdef, weights), state, pool, stops, sampling,
            slots.PagedAttentionSettings()),
            state, weights)

    return split, weights, pool, init, prefill, insert, generate


def _by_device(x, split):
    """Each device's piece of a state array, in device order along the split (kv pages by
    their page axis, the rest by their first)."""
    axis = 1 if x.ndim == 5 else 0
    shards = sorted(x.addressable_shards, key=lambda s: s.index[axis].start or 0)
    starts = sorted({s.index[axis].start or 0 for s in shards})
    assert len(starts) == split.devices
    return [np.asarray(next(s.data for s in shards if (s.index[axis].start or 0) == start))
            for start in starts]


def test_each_device_holds_its_own_slots_and_an_insert_changes_only_their_device():
    """16 slots on 8 devices (fsdp): a device holds 2 slots' arrays, an eighth of the pool
    (its 2 homes and its 2 slots' row pages) and its own free stack; inserting a request
    into slot 5 (device 2) leaves every other device's state as it was."""
    split, weights, pool, init, prefill, insert, generate = _server("fsdp", 16)
    state = jax.jit(init)()
    assert split.devices == 8 and state.kv_pages.shape[1] == 8 * pool.num_pages
    for x in jax.tree.leaves(state):
        shard = x.sharding.shard_shape(x.shape)
        assert shard[1 if x.ndim == 5 else 0] == x.shape[1 if x.ndim == 5 else 0] // 8, x.shape
    assert state.free.count.tolist() == [pool.row_pages] * 8
    before = jax.tree.map(lambda x: _by_device(x, split), state)
    ids_L = np.zeros((8,), np.int32)
    ids_L[:len(PROMPTS[1])] = PROMPTS[1]
    prefix = jax.jit(prefill)(weights, ids_L, len(PROMPTS[1]))
    after = jax.tree.map(lambda x: _by_device(x, split), jax.jit(insert)(state, prefix, 5))
    changed = {d for a, b in zip(jax.tree.leaves(before, is_leaf=lambda x: isinstance(x, list)),
                                 jax.tree.leaves(after, is_leaf=lambda x: isinstance(x, list)),
                                 strict=True)
               for d in range(8) if not np.array_equal(a[d], b[d])}
    assert changed == {2}
    assert after.live_S[2].tolist() == [False, True]  # device 2's second slot: global slot 5


def _collectives(hlo):
    """(op, replica groups as lists of device ids) of every collective in `hlo`."""
    found = []
    for line in hlo.splitlines():
        op = next((c for c in COLLECTIVES if re.search(rf"= .* {c}(-start)?\(", line)), None)
        if op is None:
            continue
        groups = re.search(r"replica_groups=(\S+?)[,}]? ", line + " ").group(1)
        iota = re.fullmatch(r"\[(\d+),(\d+)\]<=\[(\d+)\]", groups)
        if iota:
            n, size = int(iota.group(1)), int(iota.group(2))
            found.append((op, [list(range(g * size, (g + 1) * size)) for g in range(n)]))
        else:
            found.append((op, [[int(i) for i in g.split(",")]
                               for g in re.findall(r"\{([\d,]+)\}", groups)]))
    return found


@pytest.mark.default_compiler  # the pool updated in place: no copy in XLA's default program
@pytest.mark.parametrize("layout, num_slots", [("fsdp", 16), ("dp_fsdp_tp", 8)])
def test_a_decode_step_has_no_collective_over_the_batch_axes(layout, num_slots):
    """The partitioned programs: each device's pool is its own N pages (not D x N), updated
    in place (the state donated: no copy of it); a decode step and an insert communicate
    only within a tensor group (none at all on fsdp, where tensor is 1): device ids 2k,
    2k + 1 on dp_fsdp_tp, tensor being the minor axis."""
    split, weights, pool, init, prefill, insert, generate = _server(layout, num_slots)
    state = jax.eval_shape(init)
    prefix = jax.eval_shape(prefill, weights, np.zeros((8,), np.int32), 3)
    step = jax.jit(generate, donate_argnums=1).lower(weights, state).compile().as_text()
    start = jax.jit(insert, donate_argnums=0).lower(state, prefix, 5).compile().as_text()
    c = _model("qwen2").config
    buffer = rf"f32\[{c.num_layers},(\d+),{pool.page_size},\d+,{c.head_dim}\]"
    for hlo in (step, start):
        pools = {int(n) for n in re.findall(buffer, hlo)}
        assert pool.num_pages in pools and split.devices * pool.num_pages not in pools, pools
        assert not re.search(rf"= {buffer}\S* copy\(", hlo)
    # No collective carries keys or values: each device gathers its own kv heads' pages
    # (indexing the split head axis made XLA all-reduce every gathered block).
    block = rf"\[[\d,]*{pool.page_size},{c.head_dim}\]"
    results = (re.search(rf"= (.*?) {op}(-start)?\(", line) for line in step.splitlines()
               for op in COLLECTIVES)
    moved = [m.group(1) for m in results if m and re.search(block, m.group(1))]
    assert not moved, moved
    tensor = [[2 * k, 2 * k + 1] for k in range(4)]
    for hlo in (step, start):
        found = _collectives(hlo)
        assert all(groups == tensor for _, groups in found), found
        assert bool(found) == (layout == "dp_fsdp_tp" and hlo is step), found
