"""Step timing as a hook (`jaxrl bench`): every step is waited for (block_until_ready) and
timed on the host, from just before its dispatch to its output ready, so its time is the
latency of a step, not hidden by the next one's dispatch; that time is its record's
time/step_s, and its record is made at once (`needs_record`, due after every step). Each
step's line is printed; after the `warmup` steps the records (`records`) and the mean real
prompt tokens of each step's rows (`prompt_lens`) are kept for bench's medians."""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from rich.console import Console

from jaxrl.data.prompts import PromptBatch
from jaxrl.run.trainer import Fetched, Hook, Trainer


class StepTimer(Hook):
    needs_record = True  # each step recorded as soon as it was waited for

    def __init__(self, console: Console, warmup: int, total: int):
        self.console, self.warmup, self.total = console, warmup, total
        self.records: list[dict[str, Any]] = []  # the measured steps' records
        self.prompt_lens: list[float] = []  # mean real prompt tokens of their rows
        self._masks: dict[int, np.ndarray] = {}  # each step's prompt mask, at its draw
        self._start = 0.0

    def before_step(self, trainer: Trainer, step: int) -> None:
        self._start = time.perf_counter()

    def on_draw(self, trainer: Trainer, step: int, batch: PromptBatch) -> None:
        self._masks[step] = batch.mask_BxP

    def on_dispatch(self, trainer: Trainer, step: int, out: Any) -> None:
        jax.block_until_ready(out)
        trainer.step_s[step] = time.perf_counter() - self._start

    def due(self, trainer: Trainer, done: int) -> bool:
        return True

    def on_record(self, trainer: Trainer, step: int, record: dict[str, Any],
                  fetched: Fetched) -> None:
        mask_BxP = self._masks.pop(step)
        phase = "warm-up" if step < self.warmup else "measured"
        self.console.print(f"step {step + 1}/{self.total} ({phase}): "
                           f"{record['time/step_s'] * 1e3:.1f} ms")
        if step >= self.warmup:
            self.records.append(record)
            self.prompt_lens.append(float(np.mean(np.sum(mask_BxP, axis=1))))
