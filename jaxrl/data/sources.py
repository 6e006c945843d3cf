"""Rows of one dataset split from what a config names: a data file, a directory, a Hub name.

`load_rows(source, subset=None, split="train")` returns that split as a `datasets.Dataset`:

    file       .jsonl / .json / .parquet / .arrow / .csv, read by the `datasets` builder of
               its format; a file holds one split, "train"
    directory  one written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (it holds
               state.json or dataset_dict.json) is read by `datasets.load_from_disk`, a
               Dataset being the one split "train"; any other directory by
               `datasets.load_dataset(directory, subset)`, its data files naming the splits
               (train.jsonl, test.jsonl ...)
    name       anything else, e.g. "openai/gsm8k": `datasets.load_dataset(name, subset)`,
               which resolves it as `datasets` always does: from the Hub when online, else
               from the local cache of an earlier load (HF_HUB_OFFLINE=1 skips the network).
               Nothing here forces a download or forbids one.

A source that exists is a path. One that does not but looks like a path (a data file
extension, or a leading "/", "." or "~") is a missing file, a FileNotFoundError: it is never
looked up on the Hub. `subset` (a dataset config such as "main") is for names and data
directories; a file or a saved dataset has none.

Errors name the value: a source that is neither a path nor a name that loads (listing the
three kinds and the loader's reason), a text file that is not UTF-8 (its line and byte), a
split that is not there (listing the splits there are), a split with no rows, and, through
`require_columns`, a missing column.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import datasets

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow",
                ".csv": "csv"}
SOURCE_KINDS = (f"a data file ({'/'.join(FILE_FORMATS)}), a directory (written by "
                f"save_to_disk, or of data files), or a Hugging Face dataset name such as "
                f"'openai/gsm8k' (from the Hub, or from the local cache when offline)")
_SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes
_TEXT_FORMATS = ("json", "csv")  # read as UTF-8 text (the others are binary)


def describe(source: str | Path, subset: str | None = None) -> str:
    """How errors name a source: its value, and the subset when there is one."""
    return repr(str(source)) + (f" (subset {subset!r})" if subset else "")


def load_rows(source: str | Path, *, subset: str | None = None,
              split: str = "train") -> datasets.Dataset:
    """Split `split` of `source` (module docstring): it must exist and have rows."""
    splits = load_splits(source, subset=subset)
    what = describe(source, subset)
    if split not in splits:
        raise ValueError(f"split {split!r} is not in {what}; its splits are {list(splits)}")
    rows = splits[split]
    if len(rows) == 0:
        raise ValueError(f"prompt dataset {what} has no rows in split {split!r}")
    return rows


def load_splits(source: str | Path, *, subset: str | None = None,
                ) -> Mapping[str, datasets.Dataset]:
    """Every split of `source`, by name (a file's one split is "train")."""
    path = Path(source).expanduser()
    if path.is_file():
        _check_no_subset(subset, source, "file")
        return {"train": _load_file(path)}
    if path.is_dir() and _is_saved(path):
        _check_no_subset(subset, source, "saved dataset")
        return _load_dir(path, lambda: datasets.load_from_disk(str(path)))
    if path.is_dir():
        return _load_dir(path, lambda: datasets.load_dataset(str(path), subset))
    if _looks_like_path(str(source)):
        raise FileNotFoundError(f"prompt source {str(source)!r} does not exist; expected "
                                f"{SOURCE_KINDS}")
    return _load_name(str(source), subset)


def require_columns(rows: datasets.Dataset, columns: Mapping[str, str], what: str) -> None:
    """Raise naming the first of `columns` (column -> its role, e.g. "prompt") not in `rows`."""
    for column, role in columns.items():
        if column not in rows.column_names:
            raise ValueError(f"{role} column {column!r} is not in {what}; its columns are "
                             f"{rows.column_names}")


def column(rows: datasets.Dataset, name: str) -> list:
    """A column's values as a list, in one Arrow conversion: iterating `rows[name]` (datasets
    4's `Column`) converts row by row (benchmarks/README.md, "Host-side setup costs")."""
    return list(rows[name][:])  # a list whatever format `rows` has (a numpy array, say)


def _looks_like_path(source: str) -> bool:
    return Path(source).suffix.lower() in FILE_FORMATS or source.startswith(("/", ".", "~"))


def _check_no_subset(subset: str | None, source: str | Path, kind: str) -> None:
    if subset is not None:
        raise ValueError(f"data.subset={subset!r} names a config of a Hugging Face dataset, but "
                         f"{str(source)!r} is a {kind}, which has none; set data.subset to null")


def _is_saved(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _SAVED_MARKERS)


def _load_file(path: Path) -> datasets.Dataset:
    fmt = FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"unsupported prompt file extension {path.suffix!r} of {str(path)!r}: "
                         f"expected one of {', '.join(FILE_FORMATS)}")
    if path.stat().st_size == 0:
        raise ValueError(f"prompt dataset {str(path)!r} has no rows (the file is empty)")
    if fmt in _TEXT_FORMATS:
        _check_utf8(path)
    try:
        return datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # the loader fails on row-less or malformed files in several ways
        raise ValueError(f"could not read rows from {str(path)!r} as {fmt} (a file with no rows "
                         f"fails here too): {type(e).__name__}: {e}") from e


def _check_utf8(path: Path) -> None:
    """Raises naming the line (a JSONL or CSV row) and byte of the first bytes of `path` that
    are not UTF-8: the loaders would fail later, naming neither."""
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"prompt file {str(path)!r} is not UTF-8 text: line "
                                 f"{line_number}, byte {e.start + 1} "
                                 f"({line[e.start:e.start + 4]!r}): {e.reason}; save it as "
                                 f"UTF-8") from None


def _load_dir(path: Path, load: Callable[[], datasets.Dataset | datasets.DatasetDict],
              ) -> Mapping[str, datasets.Dataset]:
    try:
        loaded = load()
    except Exception as e:  # no data files, unreadable files, no such config...
        raise ValueError(f"could not load a dataset from the directory {str(path)!r} (expected "
                         f"one written by save_to_disk, or of data files; one with no rows "
                         f"fails here too): {type(e).__name__}: {e}") from e
    return {"train": loaded} if isinstance(loaded, datasets.Dataset) else loaded


def _load_name(name: str, subset: str | None) -> Mapping[str, datasets.Dataset]:
    try:
        return datasets.load_dataset(name, subset)
    except Exception as e:  # not found, not cached while offline, no such config...
        raise ValueError(f"prompt source {describe(name, subset)} is neither an existing path "
                         f"nor a dataset name that loads ({type(e).__name__}: {e}); expected "
                         f"{SOURCE_KINDS}") from e
