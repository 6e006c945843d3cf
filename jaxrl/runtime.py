"""Process-wide XLA settings jaxrl relies on; applied before JAX starts its backends.

bf16 excess precision off (`STRICT_BF16_FLAG`): XLA may skip the rounding of intermediate
bf16 results inside a fusion, and which roundings it skips depends on how each program
fuses. The sampler and the trainer are different programs over the same model code, so with
bf16 compute their log-probs of the same tokens would differ; with excess precision off both
round every bf16 op the same way and agree to fp32 roundoff. The `jaxrl` command applies
this; Python users call `configure_xla()` before their first JAX computation, or set the
flag in XLA_FLAGS themselves.

XLA:CPU's concurrency-optimized scheduler off (`SERIAL_CPU_COLLECTIVES_FLAG`; CPU only, other
backends ignore it): with it a device may start two collectives at once, each in-process
collective blocks a thread of XLA's intra-op pool (one thread per device) until all devices
join it, and a program on several CPU devices can deadlock. The flag makes that rare, not
impossible, and not for every program: XLA:CPU's executor runs a device's ready operations
as their data allow, so two independent collectives can still start in different orders on
different devices, and which scheduler order exposes it depends on the program. It concerns
several CPU devices only: one device has no collectives, and a GPU or TPU runs each device's
program in order. tests/conftest.py keeps XLA's default in its own processes (the recipes
run there) and gives the `jaxrl` processes it starts this flag; a test whose worker aborts
runs once more (tests/crash_report.py). The measurements behind both flags:
benchmarks/README.md, "Process-wide XLA flags".
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
