"""FLOP accounting: XLA counts a loop body once, our trip counts make a scan of K matmuls
cost K matmuls; sharded programs are per-device counts times devices; unknown stays unknown."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.perf.flops import PhaseCount, ProgramCost, StepFlops, program_cost

M, N, K = 64, 128, 10
MATMUL = 2 * M * N * N  # one [M, N] @ [N, N]


def _scan_of_matmuls(unroll):
    def f(x_MxN, w_KxNxN):
        def body(x, w):
            return x @ w, None
        return jax.lax.scan(body, x_MxN, w_KxNxN, unroll=unroll)[0]
    args = (jnp.ones((M, N)), jnp.ones((K, N, N)))
    return jax.jit(f).lower(*args).compile()


def test_xla_counts_a_scan_body_once_and_trip_counts_correct_it():
    looped = program_cost("scan", _scan_of_matmuls(1))
    assert looped.flops == pytest.approx(MATMUL, rel=0.01)  # K matmuls reported as one
    body = program_cost("matmul", jax.jit(jnp.matmul).lower(
        jnp.ones((M, N)), jnp.ones((N, N))).compile())
    assert body.flops == MATMUL
    step = StepFlops(generate=(), train=(PhaseCount(body, K),))
    assert step.total(decode_steps=0) == K * MATMUL
    # The unrolled scan (what the accounting compiles) has no loop: XLA sees all K.
    assert program_cost("unrolled", _scan_of_matmuls(True)).flops == pytest.approx(
        K * MATMUL, rel=0.01)


def test_per_decode_step_programs_scale_with_the_decode_steps_run():
    prefill = PhaseCount(ProgramCost("prefill", 100.0, None), 1)
    decode = PhaseCount(ProgramCost("decode", 10.0, None), 0, per_decode_step=True)
    train = PhaseCount(ProgramCost("grad", 1000.0, None), 3)
    step = StepFlops(generate=(prefill, decode), train=(train,))
    assert step.generate_flops(7) == 170.0
    assert step.train_flops() == 3000.0
    assert step.total(0) == 3100.0 and step.total(7) == 3170.0


def test_a_sharded_program_counts_every_device():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    x = jax.device_put(np.ones((8 * M, N), np.float32), rows)
    w = jax.device_put(np.ones((N, N), np.float32), NamedSharding(mesh, PartitionSpec()))
    compiled = jax.jit(jnp.matmul).lower(x, w).compile()
    per_device = compiled.cost_analysis()["flops"]
    assert per_device == pytest.approx(2 * M * N * N, rel=0.01)  # one device's rows
    assert program_cost("matmul", compiled, num_devices=8).flops == pytest.approx(
        2 * 8 * M * N * N, rel=0.01)


class _Compiled:
    def __init__(self, analysis):
        self.analysis = analysis

    def cost_analysis(self):
        if isinstance(self.analysis, Exception):
            raise self.analysis
        return self.analysis


@pytest.mark.parametrize("analysis, reason", [
    (None, "returned None"),
    ({"flops": -1.0, "bytes accessed": 10.0}, "flops=-1.0"),
    (NotImplementedError("no cost model"), "failed: no cost model"),
])
def test_unknown_flops_stay_unknown_with_the_reason(analysis, reason):
    cost = program_cost("decode", _Compiled(analysis))
    assert cost.flops is None and reason in cost.note
    step = StepFlops(generate=(PhaseCount(cost, 0, per_decode_step=True),),
                     train=(PhaseCount(ProgramCost("grad", 5.0, None), 1),))
    assert step.total(3) is None and step.generate_flops(3) is None
    assert step.train_flops() == 5.0
    assert step.unknown() == [f"decode: {cost.note}"]


def test_older_jax_list_of_dicts_is_read():
    cost = program_cost("x", _Compiled([{"flops": 12.0, "bytes accessed": 4.0}]), 2)
    assert (cost.flops, cost.bytes_accessed) == (24.0, 8.0)
