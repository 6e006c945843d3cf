"""Tasks by name: each gives its prompt rows, its verifier rewards and the fields they read.

    task = make_task("addition", num_digits=2, num_prompts=20_000, seed=0)
    rows = task.train_rows                  # datasets.Dataset: "prompt" + task field columns
    rewards = task.rewards(tokenizer)       # JaxReward / PythonReward list
    fields_P = task.device_fields(tokenizer, batch.fields)   # in-graph fields of a batch

`train_rows` always has a rendered `prompt` column (what is tokenized) and the
`field_columns` the rewards read: through `device_fields` (arrays the in-graph JAX rewards
see, one row per prompt) or, for Python rewards, as the host fields of each sample's dataset
row. Synthetic tasks also bring their own tokenizer (`tokenizer`) and draw fresh prompts for
evaluation (`eval_rows`); a dataset task has neither.

Every reward returns values in [0, 1] with 1 meaning solved, so "exact match" (every reward
at 1) is defined for every task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from jaxrl.data.prompts import PromptSource
from jaxrl.data.tasks import gsm8k
from jaxrl.data.tasks.addition import AdditionTask, addition_reward, make_addition_tokenizer
from jaxrl.data.tokenizer import decode_completions
from jaxrl.rl.rewards import JaxReward, PythonReward, Reward, RewardSet

TaskName = Literal["addition", "gsm8k"]
SYNTHETIC_TASKS = ("addition",)  # make their own prompts and tokenizer


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

    def reward_set(self, tokenizer: PreTrainedTokenizerBase,
                   rows: datasets.Dataset) -> RewardSet:
        """The task's rewards; Python ones see decoded text and the fields of `rows`' rows."""
        columns = {c: list(rows[c]) for c in self.field_columns}

        def host_fields(rows_B: np.ndarray) -> list[dict[str, Any]]:
            return [{c: values[int(r)] for c, values in columns.items()} for r in rows_B]

        def decode(ids_BxT: np.ndarray, mask_BxT: np.ndarray) -> list[str]:
            return decode_completions(tokenizer, ids_BxT, mask_BxT)

        return RewardSet(self.rewards(tokenizer), decode=decode, host_fields=host_fields)


def _no_device_fields(tokenizer, fields):
    return {}


def addition_task(num_digits: int, num_prompts: int, seed: int) -> Task:
    """Two `num_digits`-digit numbers to add; an in-graph per-digit reward (addition.py)."""
    task = AdditionTask(num_digits)

    def rewards(tokenizer):
        def reward(inputs):
            return addition_reward(inputs.completion_ids_BxC, inputs.completion_mask_BxC,
                                   inputs.fields["target_ids"])
        return [JaxReward("addition", reward)]

    def device_fields(tokenizer, fields):
        return {"target_ids": task.answer_token_ids(tokenizer, list(fields["answer"]))}

    def eval_rows(n: int, eval_seed: int) -> datasets.Dataset:
        # Held-out problems: never among the training rows (addition.py).
        return datasets.Dataset.from_list(task.sample_problems(n, eval_seed, split="eval"))

    return Task("addition",
                datasets.Dataset.from_list(task.sample_problems(num_prompts, seed, split="train")),
                ("answer",), rewards, device_fields, tokenizer=make_addition_tokenizer,
                eval_rows=eval_rows)


def gsm8k_task(source: str | Path, question_column: str, answer_column: str,
               format_weight: float) -> Task:
    """Math word problems from a jsonl/parquet file, checked by math-verify (gsm8k.py)."""
    rows = PromptSource(source, prompt_column=question_column,
                        field_columns=(answer_column,)).load()

    def render(row):
        return {"prompt": gsm8k.render_question(row[question_column]),
                "answer": row[answer_column]}

    rows = rows.map(render, remove_columns=[c for c in rows.column_names
                                            if c not in ("prompt", "answer")])

    def rewards(tokenizer):
        out: list[Reward] = [PythonReward("math", gsm8k.math_reward)]
        if format_weight:
            out.append(PythonReward("format", gsm8k.format_reward, weight=format_weight))
        return out

    return Task("gsm8k", rows, ("answer",), rewards, _no_device_fields)


def make_task(name: TaskName, *, source: str | None, prompt_column: str, answer_column: str,
              num_digits: int, num_prompts: int, format_weight: float, seed: int) -> Task:
    """The task called `name` (one of `TaskName`) with its options."""
    if name == "addition":
        return addition_task(num_digits, num_prompts, seed)
    if name == "gsm8k":
        if not source:
            raise ValueError("task gsm8k reads its questions from a file: set data.source")
        return gsm8k_task(source, prompt_column, answer_column, format_weight)
    raise ValueError(f"unknown task {name!r}; expected one of {', '.join(get_args(TaskName))}")
