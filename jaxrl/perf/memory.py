"""Will the step program fit on a device? XLA's memory analysis against the device's memory.

XLA's buffer assignment of a compiled program (`compiled.memory_analysis()`, per device for
a sharded program) gives the bytes of its arguments, outputs and temporaries. Donated
arguments (the train state a step consumes) are reused for outputs ("alias"), so

    peak = arguments + outputs - alias + temporaries + generated code

is what the program holds at once on each device. Checking it before the first step turns
an out-of-memory crash minutes into a run into an error that names the numbers and what to
change; the caller knows the config, so it supplies the suggestions.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program, from XLA's buffer assignment."""

    name: str  # "step", "generate", "train": printed as "<name> program"
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # donated argument buffers reused for outputs
    temp_bytes: int
    generated_code_bytes: int

    @property
    def peak_bytes(self) -> int:
        """arguments + outputs - alias + temporaries + generated code."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.generated_code_bytes)

    def describe(self) -> str:
        """"step program: 3.2 GiB peak per device (arguments 1.0, outputs 1.0, ...)"."""
        scale, unit = _unit(self.peak_bytes)
        parts = [f"arguments {self.argument_bytes / scale:.1f}",
                 f"outputs {self.output_bytes / scale:.1f}",
                 f"donated {'-' if self.alias_bytes else ''}{self.alias_bytes / scale:.1f}",
                 f"temporaries {self.temp_bytes / scale:.1f}"]
        if self.generated_code_bytes:  # 0 on CPU and GPU; listed only where it counts
            parts.append(f"code {self.generated_code_bytes / scale:.1f}")
        return (f"{self.name} program: {format_bytes(self.peak_bytes)} peak per device "
                f"({', '.join(parts)} {unit})")


def program_memory(name: str, compiled: jax.stages.Compiled) -> ProgramMemory | None:
    """The memory analysis of `compiled`; None where the backend does not provide one."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # backends without buffer-assignment stats raise various errors
        return None
    if stats is None:
        return None
    return ProgramMemory(name=name,
                         argument_bytes=int(stats.argument_size_in_bytes),
                         output_bytes=int(stats.output_size_in_bytes),
                         alias_bytes=int(stats.alias_size_in_bytes),
                         temp_bytes=int(stats.temp_size_in_bytes),
                         generated_code_bytes=int(stats.generated_code_size_in_bytes))


def device_memory(device: jax.Device | None = None) -> tuple[int, str]:
    """(bytes usable per device, where the figure came from).

    Accelerators report their allocator's limit in `memory_stats()["bytes_limit"]`. CPU
    devices report none; the forced CPU devices of one host share its RAM, so each gets
    physical memory / local CPU device count.
    """
    device = device if device is not None else jax.local_devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{device.device_kind} memory_stats bytes_limit"
    if device.platform != "cpu":
        raise ValueError(f"device_kind {device.device_kind!r} (platform {device.platform!r}) "
                         f"reports no memory_stats()['bytes_limit']; expected it on an "
                         f"accelerator, got {stats!r}")
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    num_devices = jax.local_device_count(device.platform)
    return host_bytes // num_devices, f"host memory / {num_devices} CPU devices"


def memory_limit(limit_gib: float | None, device: jax.Device | None = None) -> tuple[int, str]:
    """(bytes, source): `perf.memory_limit_gib` when set, else `device_memory(device)`."""
    if limit_gib is not None:
        return int(limit_gib * 2**30), "perf.memory_limit_gib"
    return device_memory(device)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """The programs of a step against the memory of one device."""

    programs: tuple[ProgramMemory, ...]
    limit_bytes: int
    limit_source: str

    @property
    def peak_bytes(self) -> int:
        """The largest program's peak: the programs of a step run one after another."""
        return max(p.peak_bytes for p in self.programs)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.limit_bytes

    def describe(self) -> str:
        """One line: each program's peak and its parts, of the device's memory."""
        limit = f"{format_bytes(self.limit_bytes)} ({self.limit_source})"
        return "; ".join(f"{p.describe()} of {limit}" for p in self.programs)


class MemoryFitError(ValueError):
    """A step program needs more memory per device than the device has."""

    def __init__(self, message: str, report: MemoryReport):
        super().__init__(message)
        self.report = report


def check_fit(programs: Sequence[ProgramMemory], limit_bytes: int, limit_source: str,
              suggestions: Sequence[str]) -> MemoryReport:
    """The report of `programs` against `limit_bytes`; raises MemoryFitError if one exceeds it.

    The error lists every program's numbers, then `suggestions` ("Try one of: ...").
    """
    if not programs:
        raise ValueError("check_fit expected at least one ProgramMemory, got none")
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be > 0, got {limit_bytes} ({limit_source})")
    report = MemoryReport(tuple(programs), int(limit_bytes), limit_source)
    if report.fits:
        return report
    lines = [f"the step needs {format_bytes(report.peak_bytes)} per device, more than the "
             f"{format_bytes(limit_bytes)} available ({limit_source}):"]
    lines += [f"  {p.describe()}" for p in report.programs]
    if suggestions:
        lines.append("Try one of:")
        lines += [f"  - {s}" for s in suggestions]
    raise MemoryFitError("\n".join(lines), report)


_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def _unit(num_bytes: int) -> tuple[int, str]:
    """The largest binary unit that `num_bytes` reaches (so small test programs stay legible)."""
    return next(((s, u) for s, u in _UNITS if abs(num_bytes) >= s), (1, "B"))


def format_bytes(num_bytes: int) -> str:
    """3435973837 -> "3.2 GiB"."""
    scale, unit = _unit(num_bytes)
    return f"{num_bytes / scale:.1f} {unit}"
