"""Every process of a multi-process CPU run reads its programs back from JAX's persistent
compilation cache on the next run (`jaxrl.distributed.cpu_cache`): without jaxrl's change
only process 0 writes, and the cache key of process 1's programs differs from process 0's,
so process 1 compiled everything again on every run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_env import free_port

pytestmark = pytest.mark.process  # starts Python processes that import jaxrl

ROOT = Path(__file__).resolve().parents[2]
PROCESS = """
import sys
import numpy as np
from jaxrl.distributed.settings import DistributedSection
from jaxrl.distributed.setup import initialize

initialize(DistributedSection(coordinator_address=sys.argv[1], num_processes=2,
                              process_id=int(sys.argv[2])), preemption=False)
import jax
from jax.experimental import multihost_utils

# A program over both processes' devices (gloo), then one on this process's own device.
rows = multihost_utils.process_allgather(np.arange(3.0) * (jax.process_index() + 1))
assert rows.tolist() == [[0.0, 1.0, 2.0], [0.0, 2.0, 4.0]], rows
assert jax.jit(lambda x: x * 2 + 1)(np.arange(4.0)).tolist() == [1.0, 3.0, 5.0, 7.0]
"""


def _run_two_processes(cache: Path, script: Path) -> list[str]:
    """Both processes' stderr (JAX logs each cache hit and miss)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device each
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_LOG_COMPILES="1",
               JAX_EXPLAIN_CACHE_MISSES="1", PYTHONPATH=str(ROOT))
    address = f"127.0.0.1:{free_port()}"
    processes = [subprocess.Popen([sys.executable, str(script), address, str(i)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
    logs = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        logs.append(err)
    return logs


def test_the_second_run_of_two_cpu_processes_compiles_nothing(tmp_path):
    script = tmp_path / "process.py"
    script.write_text(PROCESS)
    cache = tmp_path / "cache"
    first = _run_two_processes(cache, script)
    for log in first:  # an empty cache: each process compiled its programs
        assert "PERSISTENT COMPILATION CACHE MISS" in log, log[-3000:]
    second = _run_two_processes(cache, script)
    for process, log in enumerate(second):
        assert "PERSISTENT COMPILATION CACHE MISS" not in log, (process, log[-3000:])
        assert log.count("Persistent compilation cache hit") >= 2, (process, log[-3000:])
