"""`Task`: a task's prompt rows, its verifier rewards, and the fields those rewards read.

    rows = task.train_rows                  # datasets.Dataset: "prompt" + task field columns
    rewards = task.rewards(tokenizer)       # JaxReward / PythonReward list
    fields_P = task.device_fields(tokenizer, batch.fields)   # in-graph fields of a batch

`train_rows` always has a rendered `prompt` column (what is tokenized) and the
`field_columns` the rewards read: through `device_fields` (arrays the in-graph JAX rewards see,
one row per prompt) or, for Python rewards, as the host fields of each sample's dataset row
(`reward_set`). With `difficulty_column` set, `train_rows` also holds that numeric column.
Synthetic tasks also bring their own tokenizer (`tokenizer`). `eval_rows(n, seed)` gives
held-out rows rendered like the training rows, never training rows: a synthetic task draws
them, a dataset task takes the first n of its held-out split; a task without held-out rows
has None.

Every reward returns values in [0, 1] with 1 meaning solved, so "exact match" (every reward
at 1) is defined for every task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from jaxrl.data.sources import column
from jaxrl.data.tokenizer import decode_completions
from jaxrl.rl.rewards import Reward, RewardSet


@dataclasses.dataclass(frozen=True)
class Task:
    """A task's rows, rewards and fields (module docstring)."""

    name: str
    train_rows: datasets.Dataset
    field_columns: tuple[str, ...]
    rewards: Callable[[PreTrainedTokenizerBase], list[Reward]]
    device_fields: Callable[[PreTrainedTokenizerBase, dict[str, list[Any]]],
                            dict[str, np.ndarray]]
    tokenizer: Callable[[], PreTrainedTokenizerBase] | None = None
    eval_rows: Callable[[int, int], datasets.Dataset] | None = None
    difficulty_column: str | None = None
    env: str | None = None  # its own multi-turn environment (`jaxrl.envs` name), if any

    def reward_set(self, tokenizer: PreTrainedTokenizerBase,
                   rows: datasets.Dataset) -> RewardSet:
        """The task's rewards; Python ones see decoded text and the fields of `rows`' rows."""
        columns = {c: column(rows, c) for c in self.field_columns}

        def host_fields(rows_B: np.ndarray) -> list[dict[str, Any]]:
            return [{c: values[int(r)] for c, values in columns.items()} for r in rows_B]

        def decode(ids_BxT: np.ndarray, mask_BxT: np.ndarray) -> list[str]:
            return decode_completions(tokenizer, ids_BxT, mask_BxT)

        return RewardSet(self.rewards(tokenizer), decode=decode, host_fields=host_fields)


def no_device_fields(tokenizer: PreTrainedTokenizerBase,
                     fields: dict[str, list[Any]]) -> dict[str, np.ndarray]:
    """The device fields of a task whose rewards all run on the host: none."""
    return {}
