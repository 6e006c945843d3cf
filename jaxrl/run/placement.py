"""Placing a step's prompt batch on the mesh: host rows in, global device arrays out.

A batch is split over the train rules' `batch` axes. In a run of several processes every
process draws the same prompts, but each places only the rows its devices hold
(`process_rows` of the batch sharding) and `from_local_rows` assembles the global arrays.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh
from transformers import PreTrainedTokenizerBase

from jaxrl.data.prompts import PromptBatch
from jaxrl.data.tasks.registry import Task
from jaxrl.distributed import from_local_rows, process_rows
from jaxrl.rollout import Prompts
from jaxrl.sharding import AxisRules

Placed = tuple[Prompts, dict[str, jax.Array], jax.Array]  # prompts, fields_P, rows_P


@dataclasses.dataclass(frozen=True)
class Placement:
    """Puts prompt rows (and the task's device fields) on `mesh`, split by `rules`."""

    mesh: Mesh
    rules: AxisRules
    task: Task
    tokenizer: PreTrainedTokenizerBase

    def batch_sharding(self, rows: int, ndim: int) -> jax.sharding.NamedSharding:
        """The sharding of a [rows, ...] batch array of `ndim` dimensions."""
        axes = ("batch",) + (None,) * (ndim - 1)
        return self.rules.sharding(axes, (rows,) + (1,) * (ndim - 1), self.mesh)

    def process_rows(self, rows: int) -> np.ndarray:
        """The rows of a [rows, ...] batch this process's devices hold."""
        return process_rows(self.batch_sharding(rows, 2), (rows, 1))

    def place(self, batch: PromptBatch, rows: int) -> Placed:
        """A step's batch (`PromptBatches` yields this process's rows only) as global arrays
        of `rows` rows."""
        return self._place(rows, batch.ids_BxP, batch.mask_BxP, batch.rows_B,
                           self.task.device_fields(self.tokenizer, batch.fields))

    def place_rows(self, ids_BxP: np.ndarray, mask_BxP: np.ndarray, rows_B: np.ndarray,
                   fields_B: dict[str, list]) -> Placed:
        """A whole batch of host rows (the same on every process; `fields_B` the task's
        field values) on the mesh; each process places its own rows."""
        take = self.process_rows(len(ids_BxP))
        fields = {c: [values[i] for i in take] for c, values in fields_B.items()}
        return self._place(len(ids_BxP), np.asarray(ids_BxP)[take], np.asarray(mask_BxP)[take],
                           np.asarray(rows_B)[take],
                           self.task.device_fields(self.tokenizer, fields))

    def _place(self, rows: int, ids_bxP: np.ndarray, mask_bxP: np.ndarray, rows_b: np.ndarray,
               fields_b: dict[str, np.ndarray]) -> Placed:
        """This process's rows (b of the batch's `rows`) as global arrays on the mesh."""

        def put(x_b):
            x_b = np.asarray(x_b)
            return from_local_rows(self.batch_sharding(rows, x_b.ndim), x_b,
                                   (rows, *x_b.shape[1:]))

        return (Prompts(put(ids_bxP), put(mask_bxP)), {k: put(v) for k, v in fields_b.items()},
                put(np.asarray(rows_b, np.int32)))
