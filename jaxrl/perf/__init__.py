"""Performance accounting: FLOPs of the step programs from XLA's cost analysis, the peak
FLOP/s and memory bandwidth of a device (a table by device_kind, a measured matmul on CPU,
or a config override), MFU and HFU, and whether the step programs fit in device memory
(XLA's memory analysis against the device's limit). A library the training loop calls: it
never imports jaxrl.step or jaxrl.run, and commands that drive the loop (`jaxrl bench`) live in the CLI.
"""

from jaxrl.perf.memory import (
    MemoryFitError,
    MemoryReport,
    ProgramMemory,
    check_fit,
    device_memory,
    format_bytes,
    memory_limit,
    program_memory,
)
from jaxrl.perf.mfu import IMPLAUSIBLE, format_flops, plausible, utilization
from jaxrl.perf.peak import (
    Peak,
    default_cache_path,
    measure_matmul_flops,
    memory_bandwidth,
    peak_flops,
)

__all__ = [
    "IMPLAUSIBLE", "MemoryFitError", "MemoryReport", "Peak", "ProgramMemory", "check_fit",
    "default_cache_path", "device_memory", "format_bytes", "format_flops",
    "measure_matmul_flops", "memory_limit", "memory_bandwidth", "peak_flops", "plausible", "program_memory",
    "utilization",
]
