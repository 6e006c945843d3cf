"""The progress line: means over the steps since the previous line.

One step's time is not the run's: a step that also saved a checkpoint, or ran beside the
host's logging, can take several times the median. So every line averages the steps since
the last one:

    ms/step = 1e3 · mean(time/step_s)          reward = mean(reward/mean)
    tok/s   = Σ tokens / Σ time/step_s         (tokens of a step: perf/tokens_per_s · step_s)
    MFU     = Σ model FLOPs / (Σ time/step_s · devices · peak)
            = Σ perf/mfu · step_s / Σ step_s   (the time-weighted mean; when counted)

Rates are totals over totals, not means of per-step rates: a step fetched right after the
previous one has a short interval and a huge rate, which would outweigh the rest.

An MFU above 1 means the peak it was measured against is wrong (a CPU calibrated while the
machine was busy): it is shown as "?", never as a number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

HEADER = "progress: means over the steps since the previous line"


def means(records: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The module docstring's means over `records` (MFU only when every record has it)."""
    step_s_N = np.array([r["time/step_s"] for r in records], np.float64)
    out = {"time/step_s": float(step_s_N.mean()),
           "reward/mean": float(np.mean([r["reward/mean"] for r in records])),
           "perf/tokens_per_s": float(np.sum([r["perf/tokens_per_s"] for r in records] * step_s_N)
                                      / step_s_N.sum())}
    if all("perf/mfu" in r for r in records):
        mfu_N = np.array([r["perf/mfu"] for r in records], np.float64)
        out["perf/mfu"] = float(np.sum(mfu_N * step_s_N) / step_s_N.sum())
    return out


def status(records: Sequence[Mapping[str, float]]) -> str:
    """`reward R  M ms/step  T tok/s  MFU U%` of the means over `records` (non-empty)."""
    mean = means(records)
    text = (f"reward {mean['reward/mean']:.3f}  {mean['time/step_s'] * 1e3:.0f} ms/step  "
            f"{mean['perf/tokens_per_s']:.0f} tok/s")
    if "perf/mfu" in mean:
        mfu = mean["perf/mfu"]
        text += f"  MFU {mfu:.1%}" if mfu <= 1 else "  MFU ? (peak too low)"
    return text
