"""Profiling as a hook (`jaxrl bench --profile`): a `jax.profiler` trace (with a Perfetto
trace) in `directory` of the steps from step `first` on, started just before that step's
dispatch and stopped when the loop ends; open it with TensorBoard's profile plugin, XProf or
Perfetto (`jaxrl.perf.profile` sums it by op group)."""

from __future__ import annotations

from pathlib import Path

import jax
from rich.console import Console

from jaxrl.run.trainer import Hook, Trainer


class ProfileHook(Hook):
    def __init__(self, directory: Path, first: int, console: Console):
        self.directory, self.first, self.console = directory, first, console
        self.tracing = False

    def __enter__(self) -> ProfileHook:
        return self

    def __exit__(self, *exc) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
            self.console.print(f"[bold]profile[/]: {self.directory} (tensorboard --logdir "
                               f"{self.directory}, or XProf / Perfetto)")

    def before_step(self, trainer: Trainer, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.tracing = True
