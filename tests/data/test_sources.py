"""Prompt sources: every file format, both kinds of directory, a Hugging Face dataset name
resolved offline from a local cache (in a subprocess, with the real offline environment
variables), and the errors for a missing path, name, split, rows or column."""

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pytest
from datasets.data_files import DataFilesDict
from datasets.packaged_modules.parquet.parquet import Parquet, ParquetConfig

from jaxrl.data import sources
from jaxrl.data.prompts import PromptSource
from jaxrl.data.sources import load_rows, load_splits, require_columns

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [{"question": f"q{i}", "answer": f"#### {i}", "level": i % 3} for i in range(5)]
TEST = [{"question": "t0", "answer": "#### 7", "level": 2}]


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    # load_dataset caches the arrow files it makes; keep them out of the user's cache.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


def _write(path: Path, rows: list[dict]) -> Path:
    """`rows` as a data file of `path`'s format."""
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    if path.suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        frame.to_parquet(path)
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".arrow":  # the Arrow IPC stream format datasets writes
        table = pa.Table.from_pandas(frame, preserve_index=False)
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as writer:
            writer.write_table(table)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".arrow", ".csv"])
def test_every_file_format_is_its_one_split_train(tmp_path, suffix):
    path = _write(tmp_path / f"rows{suffix}", TRAIN)
    assert list(load_splits(path)) == ["train"]
    assert load_rows(path).to_list() == TRAIN
    assert load_rows(str(path), split="train").to_list() == TRAIN
    with pytest.raises(ValueError, match=r"split 'test' is not in .*rows.*its splits are "
                                         r"\['train'\]"):
        load_rows(path, split="test")


def test_a_directory_of_data_files_has_a_split_per_file(tmp_path):
    _write(tmp_path / "data" / "train.jsonl", TRAIN)
    _write(tmp_path / "data" / "test.jsonl", TEST)
    assert sorted(load_splits(tmp_path / "data")) == ["test", "train"]
    assert load_rows(tmp_path / "data").to_list() == TRAIN
    assert load_rows(tmp_path / "data", split="test").to_list() == TEST


def test_saved_datasets_load_from_disk(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "test": datasets.Dataset.from_list(TEST)}).save_to_disk(tmp_path / "dd")
    datasets.Dataset.from_list(TEST).save_to_disk(tmp_path / "one")
    assert load_rows(tmp_path / "dd", split="test").to_list() == TEST
    assert load_rows(tmp_path / "dd").to_list() == TRAIN
    assert load_rows(tmp_path / "one").to_list() == TEST  # a Dataset is the split "train"
    with pytest.raises(ValueError, match=r"split 'validation' is not in .*dd'; its splits are "
                                         r"\['train', 'test'\]"):
        load_rows(tmp_path / "dd", split="validation")
    with pytest.raises(ValueError, match=r"data.subset='main' .* saved dataset"):
        load_rows(tmp_path / "dd", subset="main")


def test_prompt_source_reads_the_split_it_names(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "test": datasets.Dataset.from_list(TEST)}).save_to_disk(tmp_path / "dd")
    source = PromptSource(str(tmp_path / "dd"), split="test", prompt_column="question",
                          field_columns=("answer", "level"))
    assert source.load().to_list() == TEST
    with pytest.raises(ValueError, match=r"field column 'solution' is not in .*dd' split "
                                         r"'test'; its columns are"):
        PromptSource(tmp_path / "dd", split="test", prompt_column="question",
                     field_columns=("solution",)).load()


def test_missing_paths_are_never_looked_up_on_the_hub(tmp_path, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError(f"load_dataset{args} was called")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    for missing in (tmp_path / "nope.jsonl", "nope.parquet", "./data/gsm8k", "~/gone"):
        with pytest.raises(FileNotFoundError) as info:
            load_rows(missing)
        message = str(info.value)
        assert repr(str(missing)) in message
        for kind in ("data file", "directory", "Hugging Face dataset name"):
            assert kind in message


def test_bad_files_are_named(tmp_path):
    (tmp_path / "rows.txt").write_text("prompt\n")
    with pytest.raises(ValueError, match=r"unsupported prompt file extension '\.txt'"):
        load_rows(tmp_path / "rows.txt")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl' has no rows"):
        load_rows(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"could not read rows from .*bad.jsonl' as json"):
        load_rows(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=r"data.subset='main' .*rows.csv' is a file"):
        load_rows(_write(tmp_path / "rows.csv", TRAIN), subset="main")
    (tmp_path / "no_files").mkdir()
    with pytest.raises(ValueError, match=r"could not load a dataset from the directory "
                                         r".*no_files'"):
        load_rows(tmp_path / "no_files")


def test_a_split_without_rows_is_an_error(tmp_path, monkeypatch):
    # datasets 5.2 refuses to write or read most row-less datasets itself (see
    # test_bad_files_are_named); a loader that returns one anyway gets the same clear error.
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN)}).save_to_disk(
        tmp_path / "dd")
    empty = datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                                  "test": datasets.Dataset.from_dict({"question": []})})
    monkeypatch.setattr(datasets, "load_from_disk", lambda path: empty)
    assert load_rows(tmp_path / "dd").to_list() == TRAIN
    with pytest.raises(ValueError, match=r"prompt dataset .*dd' has no rows in split 'test'"):
        load_rows(tmp_path / "dd", split="test")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "train.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"directory .*blank' .*no rows fails here too"):
        load_rows(tmp_path / "blank")


def test_require_columns_names_the_role_and_the_columns_there_are():
    rows = datasets.Dataset.from_list(TRAIN)
    require_columns(rows, {"question": "prompt", "level": "difficulty"}, "the rows")
    with pytest.raises(ValueError, match=r"difficulty column 'hardness' is not in the rows; "
                                         r"its columns are \['question', 'answer', 'level'\]"):
        require_columns(rows, {"question": "prompt", "hardness": "difficulty"}, "the rows")


def _cache_hub_dataset(cache: Path, repo_id: str, config: str,
                       splits: dict[str, list[dict]]) -> None:
    """What `load_dataset(repo_id, config)` leaves in the datasets cache `cache` once online.

    datasets 5.x reads a Hub dataset offline from the Arrow files its builder prepared:
    <cache>/<owner>___<name>/<config>/<version>/<hash>/ with dataset_info.json and
    <name>-<split>.arrow. The same Parquet builder prepares them here from local files, under
    the name alone (the builder accepts only hf:// data files for a repo_id); the directory
    then moves to where a load of the Hub name puts it.
    """
    owner, name = repo_id.split("/")
    files = {split: [str(_write(cache.parent / "src" / f"{split}.parquet", rows))]
             for split, rows in splits.items()}

    class Builder(Parquet):
        BUILDER_CONFIGS = [ParquetConfig(name=config,
                                         data_files=DataFilesDict.from_patterns(files))]

    build = cache.parent / "build"
    Builder(cache_dir=str(build), dataset_name=name, config_name=config,
            hash="0123abcd").download_and_prepare()
    (build / name).rename(cache / f"{owner}___{name}")


_LOAD_BY_NAME = """
import json
from jaxrl.data.prompts import PromptSource
from jaxrl.data.sources import load_rows

def error(**kw):
    try:
        load_rows(**kw)
    except ValueError as e:
        return str(e)

print(json.dumps({
    "test": PromptSource("owner/name", subset="main", split="test", prompt_column="question",
                         field_columns=("answer",)).load().to_list(),
    "train": list(load_rows("owner/name", subset="main")["question"]),
    "no_subset": list(load_rows("owner/name", split="test")["question"]),
    "no_split": error(source="owner/name", subset="main", split="validation"),
    "no_dataset": error(source="owner/missing"),
}))
"""


@pytest.mark.process
def test_a_dataset_name_loads_offline_from_the_local_cache(tmp_path):
    home = tmp_path / "hf_home"
    (home / "datasets").mkdir(parents=True)
    _cache_hub_dataset(home / "datasets", "owner/name", "main", {"train": TRAIN, "test": TEST})
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HF_TOKEN")}
    # The offline switches are read when datasets is imported: hence the fresh process. The
    # endpoint is unreachable so that any network access fails at once instead of waiting.
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_ENDPOINT="http://127.0.0.1:9")
    done = subprocess.run([sys.executable, "-c", _LOAD_BY_NAME], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["test"] == [{"question": "t0", "answer": "#### 7", "level": 2}]
    assert out["train"] == [r["question"] for r in TRAIN]
    assert out["no_subset"] == ["t0"]  # the one cached config
    assert out["no_split"].startswith("split 'validation' is not in 'owner/name' (subset "
                                      "'main'); its splits are ['train', 'test']")
    assert out["no_dataset"].startswith("prompt source 'owner/missing' is neither an existing "
                                        "path nor a dataset name that loads")
    assert sources.SOURCE_KINDS in out["no_dataset"]
