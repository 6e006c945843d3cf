"""Dataset tasks: prompt rows read from a source, rendered, checked; held-out rows likewise.

`dataset_task(config, render=..., carry_answer=..., gold=..., rewards=...)` reads split
`config.split` of `config.source` (jaxrl.data.sources) and makes the task's rows:

    prompt               render(row[data.prompt_column])
    answer               row[data.answer_column] as it is, when the task carries its answer
    <field>              row[field] for every column of data.fields, under its own name
    <difficulty_column>  as it is (numeric), when data.difficulty_column is set

Checked when the task is made, each failure a ValueError naming the column and the rows: every
column exists; the prompt column holds strings and the answer column values, none missing; the
difficulty column is numeric with none missing; every gold answer is found (`gold`, when the
task's own correctness reward reads it); no two of the columns above share a name.

Held-out rows (data.eval_source / data.eval_split, `DataSection.held_out`) are read, rendered
and checked the same way, also when the task is made; `eval_rows(n, seed)` is their first n
rows in dataset order (all of them when fewer), whatever the seed: a fixed evaluation set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from jaxrl.data.section import DataSection
from jaxrl.data.sources import describe, load_rows, require_columns
from jaxrl.data.tasks.task import Task, no_device_fields
from jaxrl.rl.rewards import Reward

# Output column -> (source column, its role in error messages).
Columns = dict[str, tuple[str, str]]
# What a column must hold: (in words, a test of its arrow type).
_STRINGS = ("strings", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t))
_NUMBERS = ("numbers", lambda t: pa.types.is_integer(t) or pa.types.is_floating(t))
_ANY = ("values", lambda t: True)


def dataset_task(config: DataSection, *, render: Callable[[str], str], carry_answer: bool,
                 gold: Callable[[str], str] | None, rewards: Sequence[Reward]) -> Task:
    """The task of `config`'s rows (module docstring) scored by `rewards`."""
    columns = _columns(config, carry_answer)
    train_rows = _rows(config.source, config.subset, config.split, columns, config, render, gold)
    held_out = config.held_out()
    eval_rows = None if held_out is None else _first_rows(
        _rows(*held_out, columns, config, render, gold))
    field_columns = (("answer",) if carry_answer else ()) + tuple(config.fields)
    return Task(config.task, train_rows, field_columns, lambda tokenizer: list(rewards),
                no_device_fields, eval_rows=eval_rows,
                difficulty_column=config.difficulty_column)


def _first_rows(rows: datasets.Dataset) -> Callable[[int, int], datasets.Dataset]:
    """eval_rows(n, seed) of fixed held-out rows: the first n, in dataset order, any seed."""
    def eval_rows(n: int, seed: int) -> datasets.Dataset:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return rows.select(range(min(n, len(rows))))
    return eval_rows


def _columns(config: DataSection, carry_answer: bool) -> Columns:
    """The task's row columns and where each comes from; a name clash is an error."""
    columns: Columns = {"prompt": (config.prompt_column, "prompt")}
    wanted = [("answer", config.answer_column, "answer")] if carry_answer else []
    wanted += [(field, field, "field") for field in config.fields]
    if config.difficulty_column is not None:
        wanted.append((config.difficulty_column, config.difficulty_column, "difficulty"))
    for name, column, role in wanted:
        if name in columns and (name == "prompt" or columns[name][0] != column):
            taken, taken_role = columns[name]
            raise ValueError(f"the {role} column {column!r} would be the task's column {name!r}, "
                             f"which already holds the {taken_role} column {taken!r}; rename "
                             f"one of them")
        columns.setdefault(name, (column, role))
    return columns


def _rows(source: str, subset: str | None, split: str, columns: Columns, config: DataSection,
          render: Callable[[str], str], gold: Callable[[str], str] | None) -> datasets.Dataset:
    """Split `split` of `source`, checked and rendered into `columns`."""
    rows = load_rows(source, subset=subset, split=split)
    what = f"{describe(source, subset)} split {split!r}"
    require_columns(rows, {column: role for column, role in columns.values()}, what)
    _check_values(rows, config.prompt_column, "prompt", what, _STRINGS)
    if "answer" in columns:
        _check_values(rows, config.answer_column, "answer", what, _ANY)
    if config.difficulty_column is not None:
        _check_values(rows, config.difficulty_column, "difficulty", what, _NUMBERS)
    if gold is not None:
        for row, value in enumerate(rows[config.answer_column]):
            try:
                gold(str(value))
            except ValueError as e:
                raise ValueError(f"answer column {config.answer_column!r} of {what}, row "
                                 f"{row}: {e}") from None

    def render_batch(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out = {name: batch[column] for name, (column, _) in columns.items()}
        out["prompt"] = [render(text) for text in out["prompt"]]
        return out

    rendered = rows.map(render_batch, batched=True, remove_columns=rows.column_names)
    return rendered.select_columns(list(columns))


def _check_values(rows: datasets.Dataset, column: str, role: str, what: str,
                  kind: tuple[str, Callable[[pa.DataType], bool]]) -> None:
    """Raise unless `column`'s arrow type is of `kind` (name, test) and no value is missing."""
    expected, accepts = kind
    values = rows.with_format("arrow")[column]
    if not accepts(values.type):
        raise ValueError(f"{role} column {column!r} of {what} must hold {expected}, but it "
                         f"holds {values.type}")
    if values.null_count:
        first = pc.index(values.is_null(), True).as_py()
        raise ValueError(f"{role} column {column!r} of {what} has {values.null_count} missing "
                         f"values (the first in row {first}); expected {expected} in every row")
