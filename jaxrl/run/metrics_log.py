"""Where a run's metrics go: `metrics.jsonl`, TensorBoard, the reward plot, the summary table.

`metrics.jsonl` holds one JSON object per step, written and flushed as soon as the step's
metrics reach the host, so a crash loses at most the steps still in flight. A resumed run
keeps the records before its checkpoint's step and writes the rest again. Keys are the
stable, slash-grouped names of DESIGN.md (`step`, `reward/mean`, `loss/policy`, ...); values
are plain floats (ints for `step`). TensorBoard (tensorboardX) gets the same scalars. In a
run of several processes only process 0 writes them; the others keep the records in memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from jaxrl.saved.files import METRICS_FILE, TENSORBOARD_DIR


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported without torch: where torch is installed,
    tensorboardX imports it (seconds of every `jaxrl` process's start) only to accept torch
    tensors, and a run writes floats. A torch already imported is used as it is."""
    import sys

    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def to_record(step: int, metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """{"step": step, name: float(value), ...} with the names sorted (a stable line layout)."""
    if "step" in metrics:
        raise ValueError("a metric may not be called 'step' (the record's own key)")
    record: dict[str, float | int] = {"step": int(step)}
    for name in sorted(metrics):
        record[name] = float(np.asarray(metrics[name]))
    return record


class MetricsLog:
    """Appends step records to `<run_dir>/metrics.jsonl` and (optionally) TensorBoard."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True,
                 resume_at: int | None = None, files: bool | None = None):
        """`resume_at`: the run resumes at this step; the records of the steps before it are
        kept (a torn last line from a killed process and later steps are dropped). `files`:
        write metrics.jsonl and TensorBoard (default: on process 0 only); without, the
        records are only kept in memory."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.records: list[dict[str, float | int]] = []
        self._file = self._writer = None
        self._closed = False
        if files is None:
            import jax

            files = jax.process_index() == 0
        if not files:
            if resume_at is not None:
                self.records = [r for r in _read_whole_lines(self.path) if r["step"] < resume_at]
            return
        if resume_at is None:
            # "x": never append to (and interleave with) another run's metrics.
            self._file = self.path.open("x", encoding="utf-8")
        else:
            self.records = [r for r in _read_whole_lines(self.path) if r["step"] < resume_at]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records),
                           encoding="utf-8")
            tmp.replace(self.path)  # atomic: a crash here leaves the old file or the new one
            self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            SummaryWriter = _summary_writer()
            # purge_step: TensorBoard hides the events a killed run wrote at or after the
            # step it resumes at (they are written again).
            self._writer = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR),
                                         purge_step=resume_at)

    def write(self, record: dict[str, float | int]) -> None:
        self._check_open()
        # NaN/inf are written as JSON's non-standard NaN/Infinity (json's default), which
        # Python and pandas read back; dropping them would hide a diverging run.
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        self.records.append(record)
        if self._writer is not None:
            for name, value in record.items():
                if name != "step":
                    self._writer.add_scalar(name, value, record["step"])

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Scalars that are not a training step's (evaluation results) to TensorBoard only."""
        self._check_open()
        if self._writer is not None:
            for name, value in scalars.items():
                self._writer.add_scalar(name, value, step)

    def _check_open(self) -> None:
        # A closed tensorboardX writer silently reopens a new events file (which can
        # overwrite the run's within the same second): refuse instead.
        if self._closed:
            raise ValueError(f"the metrics log of {str(self.run_dir)!r} is closed")

    def close(self) -> None:
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The records of a metrics.jsonl file, in order."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_whole_lines(path: Path) -> list[dict[str, float]]:
    """The records of `path` that are complete JSON lines (a missing file has none)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by a kill: it and anything after it are not trusted
    return records


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Mean of the last `window` values at each position (of all values so far at the start)."""
    values_N = np.asarray(values, np.float64)
    sums_N = np.cumsum(np.insert(values_N, 0, 0.0))
    index_N = np.arange(1, len(values_N) + 1)
    start_N = np.maximum(index_N - window, 0)
    return (sums_N[index_N] - sums_N[start_N]) / (index_N - start_N)


def plot_rewards(records: Sequence[Mapping[str, float]], path: str | Path, *,
                 title: str = "reward", target: float | None = None) -> Path:
    """A PNG of reward/mean per step (and its moving average) at `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    rewards = [r["reward/mean"] for r in records]
    window = max(1, len(rewards) // 50)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, rewards, lw=0.6, alpha=0.5, label="reward/mean")
    if window > 1:
        ax.plot(steps, moving_average(rewards, window), lw=1.8,
                label=f"moving average ({window} steps)")
    if target is not None:
        ax.axhline(target, color="gray", ls="--", lw=1, label=f"{target}")
    if 0 <= min(rewards) and max(rewards) <= 1:  # rewards in [0, 1]: show the whole range
        ax.set_ylim(0, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def summary_table(summary: Mapping[str, Any]) -> Table:
    """The end-of-run table: one row per summary entry, numbers formatted for reading."""
    table = Table(title="run summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for name, value in summary.items():
        if isinstance(value, (float, np.floating)):
            text = f"{float(value):.4g}" if math.isfinite(value) else str(float(value))
        else:
            text = str(value)
        table.add_row(name, text)
    return table
