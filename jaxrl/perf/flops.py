"""FLOPs of a step from XLA's cost analysis of its phase programs, times their trip counts.

XLA's HloCostAnalysis counts the body of a while loop (a `lax.scan`, `lax.map`, the decode
loop) once, whatever its trip count, so the cost of the whole step program is wrong by
construction. Instead each phase is compiled on its own as a loop-free program (layers
unrolled, chunk loops unrolled) and counted:

    step FLOPs = sum over phase programs p of  flops(p) x trips(p)

    prefill            x 1
    decode step        x (B-row decode steps executed, known after the step: the one-row
                          forward passes the loop ran / B)
    train programs     x their static trip counts (microbatches, minibatches, iterations)

For a program sharded over n devices cost analysis reports the FLOPs of one device, so a
program's FLOPs are that times n (what all devices execute, replicated work included).
Cost analysis may return None, or -1 for custom calls (cuDNN attention, Pallas kernels): the
program's FLOPs are then unknown (None) with the reason, and every sum that needs them is
None too — never an invented number.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """FLOPs and bytes accessed of one call of a compiled program, summed over its devices."""

    name: str
    flops: float | None  # None: unknown (see `note`)
    bytes_accessed: float | None
    note: str = ""


def program_cost(name: str, compiled: Any, num_devices: int = 1) -> ProgramCost:
    """The cost of one call of `compiled` (a jax `Compiled`) over its `num_devices` devices."""
    try:
        analysis = compiled.cost_analysis()
    except Exception as e:  # some backends do not implement it
        return ProgramCost(name, None, None, f"cost analysis failed: {e}")
    if isinstance(analysis, Sequence):  # older jax: one dict per partition
        analysis = analysis[0] if analysis else None
    if not analysis:
        return ProgramCost(name, None, None, "cost analysis returned None on this backend")

    def total(key: str) -> float | None:
        value = analysis.get(key)
        if value is None or not math.isfinite(value) or value < 0:
            return None
        return float(value) * num_devices

    flops = total("flops")
    note = ""
    if flops is None:
        note = (f"cost analysis reported flops={analysis.get('flops')!r} (a custom call such as "
                f"a cuDNN or Pallas kernel has no cost model)")
    return ProgramCost(name, flops, total("bytes accessed"), note)


@dataclasses.dataclass(frozen=True)
class PhaseCount:
    """A phase program and how many times one step runs it (`per_decode_step`: once per
    decode step executed, a number known only after the step)."""

    cost: ProgramCost
    trips: int
    per_decode_step: bool = False

    def flops(self, decode_steps: float) -> float | None:
        if self.cost.flops is None:
            return None
        return self.cost.flops * (decode_steps if self.per_decode_step else self.trips)


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """The FLOPs of one RL step as phase programs x trip counts (module docstring)."""

    generate: tuple[PhaseCount, ...]
    train: tuple[PhaseCount, ...]

    def generate_flops(self, decode_steps: float) -> float | None:
        return _sum(p.flops(decode_steps) for p in self.generate)

    def train_flops(self, token_scale: float = 1.0) -> float | None:
        """The train phases' FLOPs; `token_scale` multiplies those of the phases that run the
        model over the batch's tokens (all but the optimizer update): the share of the
        padded program's work a packed step did (`StepAccounting.metrics`)."""
        def scaled(p: PhaseCount) -> float | None:
            flops = p.flops(0)
            if flops is None or p.cost.name == "update":
                return flops
            return flops * token_scale

        return _sum(scaled(p) for p in self.train)

    def total(self, decode_steps: float, token_scale: float = 1.0) -> float | None:
        """FLOPs of a step whose decode loop ran `decode_steps` one-token steps."""
        return _sum((self.generate_flops(decode_steps), self.train_flops(token_scale)))

    def unknown(self) -> list[str]:
        """'name: reason' of every phase program whose FLOPs are unknown."""
        return [f"{p.cost.name}: {p.cost.note}" for p in (*self.generate, *self.train)
                if p.cost.flops is None]


def _sum(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else float(sum(values))


def extrapolate_layers(one: ProgramCost, two: ProgramCost, layers: int) -> ProgramCost:
    """The cost of a program with `layers` identical layers from its 1- and 2-layer
    versions: f(L) = f(1) + (L - 1) (f(2) - f(1)), exact when the layers are identical."""
    def grow(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a + (layers - 1) * (b - a)

    return ProgramCost(one.name, grow(one.flops, two.flops),
                       grow(one.bytes_accessed, two.bytes_accessed), one.note or two.note)
