"""One step's metrics record, from the step's fetched output: shared by `train` and `bench`.

    record, host = recorder.record(step, out, data_metrics)   the record, the fetched output
        time/step_s         the interval between the end stamps of two steps on the device's
                            timeline (`jaxrl.step.clock`), else between two fetches, or as
                            measured by the caller (bench times each step on the host)
        time/elapsed_s      since the recorder was made (the first dispatch)
        perf/tokens_per_s   completion tokens (sampled, the stop token included) / time/step_s
        time/generate_s, time/train_s, perf/*   from the stamps and the preflight's FLOPs
        time/weight_sync_s, time/rollout_wait_s, time/train_wait_s   algo.mode=async only
    then writes it to the metrics log (metrics.jsonl, TensorBoard).
"""

from __future__ import annotations

import time
from typing import Any

import jax

from jaxrl.run.build import Run
from jaxrl.run.metrics_log import MetricsLog, to_record
from jaxrl.run.preflight import Preflight
from jaxrl.step import StepOutput
from jaxrl.step.clock import async_times, step_seconds


class StepRecorder:
    """Records the steps of one run in order (module docstring)."""

    def __init__(self, run: Run, pre: Preflight, log: MetricsLog):
        self.run, self.pre, self.log = run, pre, log
        self.start = self._last_fetch = time.perf_counter()
        self._last_end: float | None = None
        self._last_stamps: dict[str, float] | None = None

    def record(self, step: int, out: StepOutput, data_metrics: dict[str, float],
               step_s: float | None = None) -> tuple[dict[str, float | int], StepOutput]:
        """Fetches step `step`'s output (waiting for it), writes its record; returns the
        record and the fetched output."""
        host = jax.device_get(out)
        now = time.perf_counter()
        stamps = self.run.step.clock.pop()
        if step_s is None:
            step_s = step_seconds(stamps, self._last_end)
        if step_s is None:  # no stamps: the interval between two fetches
            step_s = now - self._last_fetch
        self._last_fetch, self._last_end = now, stamps.get("end")
        previous, self._last_stamps = self._last_stamps, stamps
        metrics: dict[str, Any] = dict(host.metrics)
        metrics["time/step_s"] = step_s
        metrics["time/elapsed_s"] = now - self.start
        metrics["perf/tokens_per_s"] = (float(metrics["completion/len_mean"]) * self.run.rows
                                        / step_s)
        metrics.update(self.pre.step_metrics(metrics, step_s, stamps))
        metrics.update(async_times(stamps, previous))
        metrics.update(data_metrics)
        record = to_record(step, metrics)
        self.log.write(record)
        return record, host
