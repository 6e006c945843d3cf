"""Preemption and Ctrl-C: SIGTERM or SIGINT asks the training loop to stop after the current step.

TPU VMs, GCE spot VMs, SLURM (`--signal`, scancel, time limits) and Kubernetes all send
SIGTERM some seconds before they kill a job. While a `StopRequest` is active, SIGTERM only
records that a stop was asked for; the loop sees it after the step in flight, saves a
checkpoint, waits for it to be written and returns normally (exit status 0), so the same
command resumes the run. Ctrl-C (SIGINT) does the same, and the command then exits with
status 130; a second Ctrl-C stops at once (KeyboardInterrupt), without waiting for the step.
The previous handlers come back when the block ends. Signal handlers can only be installed
from the main thread; elsewhere the request is inert (never set).

In a run of several processes (jax.distributed), each host may get its SIGTERM at a different
step, yet all must stop after the same one and write one checkpoint together: JAX's preemption
service (its own SIGTERM handler, installed for the life of the process, so none is installed
here) agrees on that step, and `requested(step)` turns true on every process at it. The
agreement takes a step or two, so the run stops a little after the step in flight. With the
service off (JAX_ENABLE_PREEMPTION_SERVICE=false) a multi-process run gets no handler: SIGTERM
ends a process, and the health check the others. Ctrl-C in a multi-process run stops the
process at once (the others follow through the health check).
"""

from __future__ import annotations

import signal
import sys
import threading
import types

import jax
from jax.experimental import multihost_utils


class StopRequest:
    """`with StopRequest() as stop: ... if stop.signal: ...` (module docstring)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.signal: str | None = None  # the name of the first signal received
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            if signum == signal.SIGINT:
                sys.stderr.write("\nCtrl-C: stopping after the step in flight, with a "
                                 "checkpoint (press Ctrl-C again to stop at once)\n")

    def requested(self, step: int) -> bool:
        """Whether to stop after step `step`; call once per step, steps in order (all
        processes of a multi-process run get the same answer at the same step)."""
        if _jax_service() and multihost_utils.reached_preemption_sync_point(step):
            self.signal = self.signal or "SIGTERM"
        return self.signal is not None

    def __enter__(self) -> StopRequest:
        if _jax_service() or jax.distributed.is_initialized() and jax.process_count() > 1:
            return self  # JAX's preemption service handles SIGTERM, or none (module docstring)
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _jax_service() -> bool:
    """Whether JAX's preemption service runs (it starts with jax.distributed when enabled)."""
    return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)
