"""Prompt data: rows from a dataset source -> fixed-shape, left-padded batches.

`PromptSource(...).build(tokenizer)` loads the rows (one split of a data file, a directory or a
Hugging Face dataset name, through `sources.load_rows`; or an in-memory `datasets.Dataset`),
tokenizes every prompt once up front through `tokenizer.encode_prompts` (chat template when
asked for and the tokenizer has one), and returns a `PromptBatches` iterator.

- Prompts longer than `max_prompt_len` tokens (counted after the chat template) are dropped and
  counted in `stats`, never truncated: a truncated prompt is a different question.
- Every batch is `ids_BxP` int32 / `mask_BxP` bool of shape [batch_size, max_prompt_len],
  left-padded with `pad_token_id(tokenizer)`, so the shapes (and the compiled program) never
  change; with it come the rows' `fields` (column -> list) and their dataset row indices.
- Which prompts each step takes is a prompt sampler's choice (`jaxrl.data.curriculum`, set by
  `data.curriculum`; `use_sampler` after `build`). The default, `none`, visits the usable prompts
  of epoch e in the permutation drawn from (seed, e). The last `num_prompts % batch_size` prompts
  of each epoch's order are dropped, not wrapped into the next epoch: a batch then never holds
  the same prompt twice and every epoch is its own shuffle, and since the order changes each
  epoch, different prompts are left out each time. `observe` feeds results back to it.
- The iterator never ends (the loop stops at `train.max_steps`). `state()` is a flat dict of
  numpy arrays (the sampler's position, and curriculum state); `restore` of it resumes exactly,
  mid-epoch included.
- Bad input fails at `build`, before anything compiles, with an error naming the value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from jaxrl.data.curriculum import EpochSampler, PromptSampler
from jaxrl.data.sources import column, describe, load_rows, require_columns
from jaxrl.data.tokenizer import encode_prompts, pad_token_id

_CHUNK = 256  # prompts per encode_prompts call: bounds the padded scratch array


@dataclasses.dataclass(frozen=True)
class PromptStats:
    """What tokenization kept: usable prompts, prompts dropped as too long, longest kept length."""

    num_rows: int
    num_prompts: int
    num_dropped: int
    longest: int


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """One step's prompts: left-padded ids and mask, dataset row indices, carried task fields."""

    ids_BxP: np.ndarray
    mask_BxP: np.ndarray
    rows_B: np.ndarray
    positions_B: np.ndarray  # the rows' positions among the usable prompts (int64)
    fields: dict[str, list[Any]]
    # Every process's positions, in batch order (the curriculum observes the whole batch);
    # equal to positions_B in a single process.
    all_positions_B: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class PromptSource:
    """Where the prompts come from and how they are batched; `build` makes the iterator."""

    source: str | Path | datasets.Dataset  # a path or dataset name: sources.load_rows
    subset: str | None = None  # the dataset config of a Hugging Face dataset name, e.g. "main"
    split: str = "train"
    prompt_column: str = "prompt"
    field_columns: tuple[str, ...] = ()  # task fields carried along per row, e.g. ("answer",)
    chat_template: bool = True
    max_prompt_len: int = 256
    batch_size: int = 8  # prompts per step
    seed: int = 0
    tools: tuple[dict[str, Any], ...] | None = None  # function schemas for the chat template

    def __post_init__(self):
        if isinstance(self.field_columns, str):
            raise TypeError(f"field_columns must be a sequence of column names, not the string "
                            f"{self.field_columns!r}; write ({self.field_columns!r},)")
        object.__setattr__(self, "field_columns", tuple(self.field_columns))
        for name in ("max_prompt_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")

    def load(self) -> datasets.Dataset:
        """The source's rows, checked: not empty, and the prompt and field columns exist."""
        if isinstance(self.source, datasets.Dataset):
            rows, name = self.source, "the in-memory dataset"
            if len(rows) == 0:
                raise ValueError(f"prompt dataset {name} has no rows")
        else:
            rows = load_rows(self.source, subset=self.subset, split=self.split)
            name = f"{describe(self.source, self.subset)} split {self.split!r}"
        require_columns(rows, {self.prompt_column: "prompt",
                               **{c: "field" for c in self.field_columns
                                  if c != self.prompt_column}}, name)
        return rows

    def build(self, tokenizer: PreTrainedTokenizerBase) -> PromptBatches:
        """Load, tokenize every prompt once, drop (and count) the too-long ones, batch."""
        rows = self.load()
        texts = column(rows, self.prompt_column)
        for row, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"prompt column {self.prompt_column!r} must hold strings; "
                                f"row {row} holds {type(text).__name__}: {text!r}")
        ids_NxP, mask_NxP, lengths = _tokenize(tokenizer, texts, self.chat_template,
                                               self.max_prompt_len, self.tools)
        kept_N = np.flatnonzero(lengths <= self.max_prompt_len)
        num_dropped = len(texts) - len(kept_N)
        if len(kept_N) == 0:
            raise ValueError(f"all {len(texts)} prompts are longer than max_prompt_len="
                             f"{self.max_prompt_len} tokens and were dropped (the longest has "
                             f"{int(lengths.max())}); raise max_prompt_len")
        if self.batch_size > len(kept_N):
            raise ValueError(f"batch_size={self.batch_size} is larger than the {len(kept_N)} "
                             f"usable prompts ({num_dropped} of {len(texts)} dropped as longer "
                             f"than max_prompt_len={self.max_prompt_len})")
        kept_rows = rows.select(kept_N)
        fields = {c: column(kept_rows, c) for c in self.field_columns}
        stats = PromptStats(num_rows=len(texts), num_prompts=len(kept_N),
                            num_dropped=num_dropped, longest=int(lengths[kept_N].max()))
        return PromptBatches(ids_NxP, mask_NxP, kept_N.astype(np.int64), fields,
                             batch_size=self.batch_size, seed=self.seed, stats=stats)


def _tokenize(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], chat_template: bool,
              max_len: int, tools: tuple[dict[str, Any], ...] | None = None,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids_KxP, mask_KxP) of the K prompts that fit in P=max_len, and every prompt's length."""
    pad = pad_token_id(tokenizer)
    ids_parts, mask_parts, length_parts = [], [], []
    for start in range(0, len(texts), _CHUNK):
        ids_CxL, mask_CxL = encode_prompts(tokenizer, texts[start:start + _CHUNK],
                                           chat_template=chat_template, tools=tools)
        lengths_C = mask_CxL.sum(axis=1)
        keep_C = lengths_C <= max_len
        # Left padding puts every prompt's tokens at the right edge: the kept prompts lie
        # wholly within the last `width` columns, which move to the right edge of P.
        width = min(ids_CxL.shape[1], max_len)
        ids_CxP = np.full((int(keep_C.sum()), max_len), pad, np.int32)
        mask_CxP = np.zeros((int(keep_C.sum()), max_len), bool)
        ids_CxP[:, max_len - width:] = ids_CxL[keep_C, ids_CxL.shape[1] - width:]
        mask_CxP[:, max_len - width:] = mask_CxL[keep_C, mask_CxL.shape[1] - width:]
        ids_parts.append(ids_CxP)
        mask_parts.append(mask_CxP)
        length_parts.append(lengths_C)
    return np.concatenate(ids_parts), np.concatenate(mask_parts), np.concatenate(length_parts)


class PromptBatches:
    """Endless iterator of `PromptBatch`es; a prompt sampler (`jaxrl.data.curriculum`) picks
    each step's positions, by default uniform epochs (`none`).

    Every process draws the same global batch of `batch_size` prompts and yields its contiguous
    rows: [i*B/P, (i+1)*B/P) by process index, or the rows its devices hold (`use_rows`);
    `observe` takes the global batch's positions (`all_positions_B`) and
    success, so all processes' samplers stay in step.
    """

    def __init__(self, ids_NxP: np.ndarray, mask_NxP: np.ndarray, rows_N: np.ndarray,
                 fields: dict[str, list[Any]], *, batch_size: int, seed: int, stats: PromptStats,
                 sampler: PromptSampler | None = None, process_index: int = 0,
                 process_count: int = 1):
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must be in 0..process_count-1 "
                             f"with process_count={process_count}")
        if batch_size % process_count:
            raise ValueError(f"batch_size={batch_size} must be divisible by process_count="
                             f"{process_count}: every process takes an equal slice of a batch")
        self.ids_NxP, self.mask_NxP, self.rows_N, self.fields = ids_NxP, mask_NxP, rows_N, fields
        self.num_prompts, self.batch_size, self.seed, self.stats = (
            len(ids_NxP), batch_size, seed, stats)
        self.batches_per_epoch = len(ids_NxP) // batch_size
        local = batch_size // process_count
        self._rows = slice(process_index * local, (process_index + 1) * local)
        self.sampler: PromptSampler = EpochSampler(self.num_prompts, batch_size, seed)
        if sampler is not None:
            self.use_sampler(sampler)

    def use_rows(self, rows_b: np.ndarray) -> None:
        """Yield these rows of every batch (the rows this process's devices hold, ascending)."""
        rows_b = np.asarray(rows_b)
        if (rows_b.ndim != 1 or not len(rows_b) or rows_b.dtype.kind not in "iu"
                or rows_b.min() < 0 or rows_b.max() >= self.batch_size
                or (np.diff(rows_b) <= 0).any()):
            raise ValueError(f"rows must be ascending row indices of a batch of "
                             f"{self.batch_size}, got {rows_b!r}")
        self._rows = rows_b

    def use_sampler(self, sampler: PromptSampler) -> None:
        """Draw with `sampler` (e.g. `make_prompt_sampler(cfg.data.curriculum, ...)`) from now
        on; only before the first batch, so that step numbers and state stay consistent."""
        if self.sampler.step:
            raise ValueError(f"use_sampler after {self.sampler.step} batches were drawn: "
                             f"choose the sampler before the first batch")
        if (sampler.num_prompts, sampler.batch_size) != (self.num_prompts, self.batch_size):
            raise ValueError(f"the sampler is for {sampler.num_prompts} prompts in batches of "
                             f"{sampler.batch_size}, this iterator has {self.num_prompts} and "
                             f"{self.batch_size}")
        self.sampler = sampler

    @property
    def step(self) -> int:
        """Batches drawn so far: the step whose batch `next` returns."""
        return self.sampler.step

    def __iter__(self) -> PromptBatches:
        return self

    def __next__(self) -> PromptBatch:
        all_B = self.sampler.draw()
        take_B = all_B[self._rows]
        return PromptBatch(ids_BxP=self.ids_NxP[take_B], mask_BxP=self.mask_NxP[take_B],
                           rows_B=self.rows_N[take_B], positions_B=take_B,
                           fields={c: [v[i] for i in take_B] for c, v in self.fields.items()},
                           all_positions_B=all_B)

    def observe(self, step: int, positions_B: np.ndarray, success_B: np.ndarray,
                signal_B: np.ndarray | None = None) -> None:
        """Per-prompt success and learning signal in [0, 1] of step `step`'s global batch;
        they steer the batch of step `step + LAG` (`jaxrl.data.curriculum`)."""
        self.sampler.observe(step, positions_B, success_B, signal_B)

    def state(self) -> dict[str, np.ndarray]:
        """The position and curriculum state: a flat dict of numpy arrays (an orbax pytree)."""
        return self.sampler.state()

    def restore(self, state: Mapping[str, Any]) -> None:
        """Resume at a position from `state()`; the following batches are the same as then."""
        self.sampler.restore(state)

    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics log: data/epoch and the curriculum's own."""
        return self.sampler.metrics()
