"""Prompt data: rows from a file or a `datasets.Dataset` -> fixed-shape, left-padded batches.

`PromptSource(...).build(tokenizer)` loads the rows with the `datasets` library (a local
`.jsonl`/`.json` or `.parquet` file, or an in-memory `datasets.Dataset`), tokenizes every prompt
once up front through `tokenizer.encode_prompts` (chat template when asked for and the tokenizer
has one), and returns a `PromptBatches` iterator.

- Prompts longer than `max_prompt_len` tokens (counted after the chat template) are dropped and
  counted in `stats`, never truncated: a truncated prompt is a different question.
- Every batch is `ids_BxP` int32 / `mask_BxP` bool of shape [batch_size, max_prompt_len],
  left-padded with `pad_token_id(tokenizer)`, so the shapes (and the compiled program) never
  change; with it come the rows' `fields` (column -> list) and their dataset row indices.
- Epoch e visits the usable prompts in the permutation drawn from (seed, e). The last
  `num_prompts % batch_size` prompts of each epoch's order are dropped, not wrapped into the next
  epoch: a batch then never holds the same prompt twice and every epoch is its own shuffle, and
  since the order changes each epoch, different prompts are left out each time.
- The iterator never ends (the loop stops at `train.max_steps`). `state()` is
  `{"epoch": e, "offset": o}` (prompts already taken from epoch e's order); `restore` of it
  resumes exactly, mid-epoch included.
- Bad input fails at `build`, before anything compiles, with an error naming the value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from jaxrl.data.tokenizer import encode_prompts, pad_token_id

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
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
    fields: dict[str, list[Any]]


@dataclasses.dataclass(frozen=True)
class PromptSource:
    """Where the prompts come from and how they are batched; `build` makes the iterator."""

    source: str | Path | datasets.Dataset
    prompt_column: str = "prompt"
    field_columns: tuple[str, ...] = ()  # task fields carried along per row, e.g. ("answer",)
    chat_template: bool = True
    max_prompt_len: int = 256
    batch_size: int = 8  # prompts per step
    seed: int = 0

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
        else:
            rows, name = _load_file(Path(self.source)), repr(str(self.source))
        if len(rows) == 0:
            raise ValueError(f"prompt dataset {name} has no rows")
        for column in (self.prompt_column, *self.field_columns):
            if column not in rows.column_names:
                kind = "prompt" if column == self.prompt_column else "field"
                raise ValueError(f"{kind} column {column!r} is not in {name}; "
                                 f"its columns are {rows.column_names}")
        return rows

    def build(self, tokenizer: PreTrainedTokenizerBase) -> PromptBatches:
        """Load, tokenize every prompt once, drop (and count) the too-long ones, batch."""
        rows = self.load()
        texts = list(rows[self.prompt_column])
        for row, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"prompt column {self.prompt_column!r} must hold strings; "
                                f"row {row} holds {type(text).__name__}: {text!r}")
        ids_NxP, mask_NxP, lengths = _tokenize(tokenizer, texts, self.chat_template,
                                               self.max_prompt_len)
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
        fields = {c: list(kept_rows[c]) for c in self.field_columns}
        stats = PromptStats(num_rows=len(texts), num_prompts=len(kept_N),
                            num_dropped=num_dropped, longest=int(lengths[kept_N].max()))
        return PromptBatches(ids_NxP, mask_NxP, kept_N.astype(np.int64), fields,
                             batch_size=self.batch_size, seed=self.seed, stats=stats)


def _load_file(path: Path) -> datasets.Dataset:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"unsupported prompt file extension {path.suffix!r} of {str(path)!r}: "
                         f"expected one of {', '.join(_FORMATS)}")
    if path.stat().st_size == 0:
        raise ValueError(f"prompt dataset {str(path)!r} has no rows (the file is empty)")
    try:
        return datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # the loader fails on row-less or malformed files in several ways
        raise ValueError(f"could not read rows from {str(path)!r} as {fmt} (a file with no rows "
                         f"fails here too): {type(e).__name__}: {e}") from e


def _tokenize(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], chat_template: bool,
              max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids_KxP, mask_KxP) of the K prompts that fit in P=max_len, and every prompt's length."""
    pad = pad_token_id(tokenizer)
    ids_parts, mask_parts, length_parts = [], [], []
    for start in range(0, len(texts), _CHUNK):
        ids_CxL, mask_CxL = encode_prompts(tokenizer, texts[start:start + _CHUNK],
                                           chat_template=chat_template)
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
    """Endless iterator of `PromptBatch`es; epoch e uses the permutation drawn from (seed, e)."""

    def __init__(self, ids_NxP: np.ndarray, mask_NxP: np.ndarray, rows_N: np.ndarray,
                 fields: dict[str, list[Any]], *, batch_size: int, seed: int, stats: PromptStats):
        if not 1 <= batch_size <= len(ids_NxP):
            raise ValueError(f"batch_size={batch_size} must be between 1 and the "
                             f"{len(ids_NxP)} usable prompts")
        self.ids_NxP, self.mask_NxP, self.rows_N, self.fields = ids_NxP, mask_NxP, rows_N, fields
        self.batch_size, self.seed, self.stats = batch_size, seed, stats
        self.batches_per_epoch = len(ids_NxP) // batch_size
        self._epoch, self._offset = 0, 0
        self._order_epoch, self._order_N = -1, np.empty(0, np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s visiting order of the usable prompts (positions, not dataset rows)."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng((self.seed, epoch))
            self._order_epoch, self._order_N = epoch, rng.permutation(len(self.ids_NxP))
        return self._order_N

    def __iter__(self) -> PromptBatches:
        return self

    def __next__(self) -> PromptBatch:
        take_B = self.order(self._epoch)[self._offset:self._offset + self.batch_size]
        self._offset += self.batch_size
        if self._offset + self.batch_size > len(self.ids_NxP):  # the rest is the remainder
            self._epoch, self._offset = self._epoch + 1, 0
        return PromptBatch(ids_BxP=self.ids_NxP[take_B], mask_BxP=self.mask_NxP[take_B],
                           rows_B=self.rows_N[take_B],
                           fields={c: [v[i] for i in take_B] for c, v in self.fields.items()})

    def state(self) -> dict[str, int]:
        """The position: epoch, and prompts already taken from its order (JSON-serialisable)."""
        return {"epoch": self._epoch, "offset": self._offset}

    def restore(self, state: dict[str, int]) -> None:
        """Resume at a position from `state()`; the following batches are the same as then."""
        if set(state) != {"epoch", "offset"}:
            raise ValueError(f"prompt iterator state must have keys 'epoch' and 'offset', "
                             f"got {sorted(state)}")
        epoch, offset = state["epoch"], state["offset"]
        last = (self.batches_per_epoch - 1) * self.batch_size
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, offset)):
            raise TypeError(f"prompt iterator state values must be ints, got {state!r}")
        if epoch < 0 or not 0 <= offset <= last or offset % self.batch_size:
            raise ValueError(f"prompt iterator state {state!r} is out of range: offset must be "
                             f"a multiple of batch_size={self.batch_size} from 0 to {last}, "
                             f"epoch non-negative")
        self._epoch, self._offset = epoch, offset
