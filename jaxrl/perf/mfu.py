"""FLOP utilization of a step, and how FLOP counts are printed.

    utilization = FLOPs per step / (step seconds × devices × peak FLOP/s per device)

With *model* FLOPs (XLA's cost analysis of the programs compiled without rematerialisation,
every loop multiplied by its trip count) this is the MFU; with *hardware* FLOPs (the same
with remat as configured, so recomputed activations count) it is the HFU. HFU >= MFU, and
only MFU compares fairly across remat settings and libraries.

A utilization above 1 is impossible: it means the peak is wrong (a CPU's matmul rate measured
while the machine was busy, or a wrong perf.peak_tflops). Such a value is never reported as
a number (`plausible`): summaries show null and say why (IMPLAUSIBLE).
"""

from __future__ import annotations

_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def utilization(flops_per_step: float, step_s: float, num_devices: int,
                peak_flops_per_device: float) -> float:
    """flops_per_step / (step_s · num_devices · peak_flops_per_device): MFU or HFU."""
    if not flops_per_step >= 0:
        raise ValueError(f"flops_per_step must be >= 0, got {flops_per_step}")
    if not step_s > 0:
        raise ValueError(f"step_s must be > 0 seconds, got {step_s}")
    if not num_devices > 0:
        raise ValueError(f"num_devices must be > 0, got {num_devices}")
    if not peak_flops_per_device > 0:
        raise ValueError(f"peak_flops_per_device must be > 0 FLOP/s, got "
                         f"{peak_flops_per_device}")
    return flops_per_step / (step_s * num_devices * peak_flops_per_device)


IMPLAUSIBLE = ("above 100%, so the peak it is measured against is too low (a CPU peak measured "
               "while the machine was busy, or perf.peak_tflops); set perf.peak_tflops, or "
               "measure the CPU again with `jaxrl bench` on an idle machine")


def plausible(fraction: float | None) -> float | None:
    """`fraction` when it can be a utilization (<= 1), else None (module docstring)."""
    return fraction if fraction is not None and fraction <= 1 else None


def format_flops(flops: float | None) -> str:
    """1.23e12 -> "1.23 TFLOP"; None (and XLA's -1 for custom calls) -> "n/a (...)".

    An unavailable count is said to be so rather than printed as a number.
    """
    if flops is None or flops < 0:
        return "n/a (cost analysis unavailable)"
    scale, prefix = next(((s, p) for s, p in _PREFIXES if flops >= s), (1.0, ""))
    return f"{flops / scale:.2f} {prefix}FLOP"
