"""The RL engine's rows do not depend on the devices: the same tokens and log-probs, bit for
bit, on 1 device, 8 devices of one process and 2 processes x 4 devices (gloo), fsdp layout.

Bit-equal, log-probs too, because the fsdp rollout rules keep the weights whole on every
device (tensor is 1) and split only rows: each device runs its own rows' loop, with its own
keys, and no floating-point sum crosses devices (the weights' all-gather copies; the loop's
counts are integers). So, unlike the training step's (tests/distributed/test_multiprocess.py),
in-process and gloo collectives give the same bits. Each device's slot count differs (8 on
one device, 2 on each of 8): the engine takes at least 2, so every decode step is a matrix
product, never XLA's matrix-vector path (`slot_count.max_concurrent_decodes`).
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.distributed import engine_rows
from tests.launch_env import free_port

pytestmark = pytest.mark.process  # two processes join over jax.distributed

ROOT = Path(__file__).resolve().parents[2]


def _start_two_processes(out: Path) -> list[subprocess.Popen]:
    """`python -m tests.distributed.engine_rows` as 2 processes x 4 CPU devices."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES="2",
               PYTHONPATH=str(ROOT))
    return [subprocess.Popen([sys.executable, "-m", "tests.distributed.engine_rows", str(out)],
                             cwd=ROOT, env={**env, "JAX_PROCESS_ID": str(i)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]


@pytest.mark.default_compiler  # bit-equal to the two processes, which compile as users do
def test_rows_are_identical_on_1_8_and_2x4_devices(tmp_path):
    out = tmp_path / "rows.npz"
    processes = _start_two_processes(out)  # they run while this process samples its two
    try:
        one = engine_rows.rows(jax.devices()[:1])
        eight = engine_rows.rows()  # the 8 devices tests/conftest.py gives this process
        for p in processes:
            log, _ = p.communicate(timeout=300)
            assert p.returncode == 0, log[-4000:]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.communicate()
    two = dict(np.load(out))

    # The meshes: no split, 8 ways in one process, 8 ways over 2 processes (fsdp spans them).
    assert (one["mesh"].tolist(), int(one["row_shards"])) == ([1, 1, 1], 1)
    for many, processes_ in ((eight, 1), (two, 2)):
        assert many["mesh"].tolist() == [1, 8, 1] and int(many["row_shards"]) == 8
        assert int(many["processes"]) == processes_
    # No stop tokens: each row ends at its own limit (2..8 new tokens), so slots free and
    # are refilled mid-loop on every mesh.
    limits = engine_rows.LIMITS
    assert limits.min() == 2 and limits.max() == engine_rows.NEW_TOKENS
    np.testing.assert_array_equal(one["completion_mask_BxC"].sum(axis=1), limits)
    for many in (eight, two):
        for field in engine_rows.FIELDS:
            np.testing.assert_array_equal(many[field], one[field], err_msg=field)
