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

import time
from collections.abc import Mapping, Sequence

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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


class ProgressBar:
    """A live bar on a terminal, else a line every `print_every` steps; both show the means
    over the steps since the previous line (`status`)."""

    def __init__(self, console: Console, max_steps: int, start_step: int, print_every: int):
        self.console, self.max_steps, self.print_every = console, max_steps, print_every
        self.since: list[dict[str, float]] = []
        self.lines = 0
        self.progress = Progress(
            TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
            console=console, disable=not console.is_terminal)
        self.task = self.progress.add_task("train", total=max_steps, completed=start_step,
                                           status="compiling...")
        self.start = time.perf_counter()

    def __enter__(self) -> ProgressBar:
        self.progress.__enter__()
        if not self.console.is_terminal:
            self.console.print(f"{HEADER} (every {self.print_every} steps)")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def add(self, record: dict[str, float]) -> None:
        """Counts one recorded step; shows the means when a line is due."""
        step = int(record["step"])
        self.since.append(record)
        due = (step + 1) % self.print_every == 0 or step == self.max_steps - 1
        if not (due or self.lines == 0):  # the first line comes after the first step
            self.progress.update(self.task, completed=step + 1)
            return
        text = status(self.since)
        self.since, self.lines = [], self.lines + 1
        self.progress.update(self.task, completed=step + 1, status=text)
        if not self.console.is_terminal:
            elapsed = time.perf_counter() - self.start
            self.console.print(f"step {step + 1}/{self.max_steps}  {text}  ({elapsed:.0f}s)")
