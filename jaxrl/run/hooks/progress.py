"""The progress bar and its periodic lines (`jaxrl.run.progress`) as a hook: each record is
added as it is made; the bar is shown around the whole loop."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from jaxrl.run.progress import ProgressBar
from jaxrl.run.trainer import Fetched, Hook, Trainer


class ProgressHook(Hook):
    def __init__(self, console: Console, max_steps: int, start_step: int, print_every: int):
        self.bar = ProgressBar(console, max_steps, start_step, print_every)

    def __enter__(self) -> ProgressHook:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def on_record(self, trainer: Trainer, step: int, record: dict[str, Any],
                  fetched: Fetched) -> None:
        self.bar.add(record)
