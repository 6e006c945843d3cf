"""Process-wide XLA settings jaxrl relies on; applied before JAX starts its backends.

XLA may skip the rounding of intermediate bf16 results inside a fusion ("excess
precision"), and which roundings it skips depends on how each program happens to fuse. The
sampler and the trainer are different programs over the same model code, so with bf16
compute their log-probs of the same tokens then differ by up to ~1e-2 (measured on CPU);
with excess precision off both round every bf16 op the same way and agree to fp32 roundoff
(~2e-7). The `jaxrl` command applies this; Python users call `configure_xla()` before
their first JAX computation, or set the flag in XLA_FLAGS themselves.

XLA:CPU's concurrency-optimized scheduler is turned off (`SERIAL_CPU_COLLECTIVES_FLAG`; CPU
only, other backends ignore it). With it, a program on several CPU devices can deadlock: a
device may start two collectives at once (one inside a while loop, one outside), each
in-process collective blocks a thread of XLA's intra-op pool until all devices join it, and
that pool had 8 threads for 8 devices. Measured (jax 0.10.2, 2 cores, 8 fake devices, the
split-mode GRPO cell of docs/composition.md as `jaxrl train`, 3 steps): all 8 pool threads
blocked in two all-gathers of one execution (op 4 with 1 device arrived, op 156 with 7),
0 CPU time over 30 s and still stuck after 110 s (no starvation: a longer
`--xla_cpu_collective_call_terminate_timeout_seconds` only delays the abort); 11 of 15 runs
aborted, against 0 of 5 with the flag, whose metrics were the same floats.

The flag makes that deadlock rare, not impossible, and not for every program: XLA:CPU's
executor runs a device's ready operations as their data allow, and two independent
collectives of one program can still be started in different orders by different devices,
each then waiting for the others. Which scheduler order exposes it depends on the program
(jax 0.10.2, 8 fake devices): the shipped recipes' 2-step trainings, 5 in a row in one
process, aborted in 3 of 4 processes with the flag (asynchronous dispatch off did not help)
and in 0 of 4 without it. It is XLA:CPU's, on several CPU devices only (tests): one device
has no collectives, and a GPU or TPU runs each device's program in order. tests/conftest.py
keeps XLA's default in its own processes (the recipes run there) and gives the `jaxrl`
processes it starts this flag; a test whose worker aborts runs once more
(tests/crash_report.py).
"""

from __future__ import annotations

import os

STRICT_BF16_FLAG = "--xla_allow_excess_precision=false"
SERIAL_CPU_COLLECTIVES_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def configure_xla() -> None:
    """Adds jaxrl's XLA flags to XLA_FLAGS unless the user already set them either way."""
    for flag in (STRICT_BF16_FLAG, SERIAL_CPU_COLLECTIVES_FLAG):
        flags = os.environ.get("XLA_FLAGS", "")
        if flag.split("=")[0] not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
