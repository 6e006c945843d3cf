"""What a test gives the `jaxrl` processes it starts only to see them run (not to compare their
numbers with a golden or with another run's).

FAST_COMPILE: LLVM's cheap settings. Such processes still compile programs: multi-turn programs
(host callbacks) are never stored in the persistent cache, and each new combination compiles
once (every process of a multi-process CPU run stores its own: `jaxrl.distributed.cpu_cache`);
these flags nearly halve that compile time and leave the step time as it is (gloo-bound).

TEST_COMPILE: those and XLA:CPU's older loop emitters for fused ops (its newer MLIR-based
fusion emitters take half of a small program's compile time), for the test processes
themselves (tests/conftest.py), the processes that inherit their XLA_FLAGS and the docs'
blocks. Not for the runs compared number for number with a run of another program (a bench
with a train, two processes with one): the older emitters round two such programs apart where
the newer ones give equal bits.

SMALL: 4 fake devices in all (2 per process of a two-process run): gloo's TCP collectives
(~2 s per quickstart step on 8 devices, ~0.5 s on 4) and the threads of more devices cost this
2-core machine most of a multi-process test's time.
"""

import socket

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
TEST_COMPILE = f"{FAST_COMPILE} --xla_cpu_use_fusion_emitters=false"
SMALL = {"JAXRL_CPU_DEVICES": "4"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a coordinator's, a server's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
