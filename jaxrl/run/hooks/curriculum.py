"""The prompt sampler (`jaxrl.data.curriculum`) observes each step's per-prompt success and
learning signal from its fetched output, in step order, as the step is recorded."""

from __future__ import annotations

from typing import Any

from jaxrl.run.trainer import Fetched, Hook, Trainer


class CurriculumHook(Hook):
    def on_record(self, trainer: Trainer, step: int, record: dict[str, Any],
                  fetched: Fetched) -> None:
        trainer.run.batches.observe(step, fetched.positions_B, fetched.out.success_P,
                                    fetched.out.signal_P)
