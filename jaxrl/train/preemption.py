"""Preemption: SIGTERM asks the training loop to stop after the current step.

TPU VMs, GCE spot VMs, SLURM (`--signal`, scancel, time limits) and Kubernetes all send
SIGTERM some seconds before they kill a job. While a `StopRequest` is active, SIGTERM only
records that a stop was asked for; the loop sees it after the step in flight, saves a
checkpoint, waits for it to be written and returns normally (exit status 0), so the same
command resumes the run. The previous handler comes back when the block ends. Signal handlers
can only be installed from the main thread; elsewhere the request is inert (never set).
"""

from __future__ import annotations

import signal
import threading
import types


class StopRequest:
    """`with StopRequest() as stop: ... if stop.signal: ...` (module docstring)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self.signal: str | None = None  # the name of the first signal received
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
