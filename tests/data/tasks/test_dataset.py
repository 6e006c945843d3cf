"""Dataset task rows: every bad input named when the task is made (columns, values, gold
answers, name clashes, empty data, prompts that all overflow), and held-out rows for
evaluation rendered like the training rows."""

import json
import string

import datasets
import pytest

from jaxrl.config import DataSection
from jaxrl.data.prompts import PromptSource
from jaxrl.data.tasks import gsm8k
from jaxrl.data.tasks.registry import make_task
from jaxrl.data.tokenizer import make_char_tokenizer

TRAIN = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}", "level": i % 3,
          "id": i} for i in range(6)]
TEST = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}", "level": 1, "id": 100 + i}
        for i in range(4)]


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _task(source, task="gsm8k", **keys):
    return make_task(DataSection(task=task, source=source, prompt_column="question", **keys),
                     seed=0)


@pytest.fixture
def data_dir(tmp_path):
    """A directory of data files: the splits "train" and "test"."""
    _jsonl(tmp_path / "data" / "train.jsonl", TRAIN)
    _jsonl(tmp_path / "data" / "test.jsonl", TEST)
    return str(tmp_path / "data")


@pytest.mark.parametrize("keys, message", [
    (dict(prompt_column="problem"), "prompt column 'problem' is not in"),
    (dict(answer_column="solution"), "answer column 'solution' is not in"),
    (dict(fields=["id", "source"]), "field column 'source' is not in"),
    (dict(difficulty_column="hardness"), "difficulty column 'hardness' is not in"),
])
def test_a_missing_column_is_named_with_its_role(data_dir, keys, message):
    with pytest.raises(ValueError, match=message) as info:
        make_task(DataSection(**{"task": "gsm8k", "source": data_dir,
                                "prompt_column": "question", **keys}), seed=0)
    assert "its columns are ['question', 'answer', 'level', 'id']" in str(info.value)
    assert f"{data_dir!r} split 'train'" in str(info.value)


def test_prompts_must_be_strings_and_none_missing(tmp_path):
    numbers = _jsonl(tmp_path / "numbers.jsonl", [{"question": 7, "answer": "1"}])
    with pytest.raises(ValueError, match="prompt column 'question' .* must hold strings, but "
                                         "it holds int64"):
        _task(numbers)
    gaps = _jsonl(tmp_path / "gaps.jsonl", [{"question": "a", "answer": "1"},
                                            {"question": None, "answer": "2"}])
    with pytest.raises(ValueError, match=r"prompt column 'question' .* has 1 missing values "
                                         r"\(the first in row 1\)"):
        _task(gaps)


def test_difficulty_must_be_numeric_and_none_missing(tmp_path):
    rows = [{"question": "a", "answer": "1", "level": "Level 3", "score": 0.5, "gap": 1},
            {"question": "b", "answer": "2", "level": "Level 1", "score": 2.0, "gap": None}]
    source = _jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError, match="difficulty column 'level' .* must hold numbers, but "
                                         "it holds string"):
        _task(source, difficulty_column="level")
    with pytest.raises(ValueError, match="difficulty column 'gap' .* has 1 missing values"):
        _task(source, difficulty_column="gap")
    task = _task(source, difficulty_column="score")
    assert list(task.train_rows["score"]) == [0.5, 2.0] and task.difficulty_column == "score"


def test_every_gold_answer_is_checked_when_the_task_is_made(tmp_path):
    source = _jsonl(tmp_path / "rows.jsonl", [*TRAIN[:2], {"question": "q", "answer": "#### "}])
    with pytest.raises(ValueError, match=r"answer column 'answer' of .* row 2: no answer in the "
                                         r"answer field '#### '"):
        _task(source)
    missing = _jsonl(tmp_path / "missing.jsonl", [{"question": "q", "answer": None}])
    with pytest.raises(ValueError, match="answer column 'answer' .* has 1 missing values"):
        _task(missing)
    math_rows = _jsonl(tmp_path / "math.jsonl", [{"question": "q", "answer": "\\boxed{}"}])
    with pytest.raises(ValueError, match="row 0: no answer in the answer field"):
        _task(math_rows, task="math")


def test_two_columns_with_one_name_are_an_error(data_dir):
    with pytest.raises(ValueError, match="the difficulty column 'prompt' would be the task's "
                                         "column 'prompt'"):
        _task(data_dir, difficulty_column="prompt")
    with pytest.raises(ValueError, match="the difficulty column 'answer' would be the task's "
                                         "column 'answer', which already holds the answer "
                                         "column 'level'"):
        _task(data_dir, answer_column="level", difficulty_column="answer")


def test_empty_data_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl' has no rows"):
        _task(str(empty))


def test_a_task_whose_prompts_all_overflow_fails_to_build(data_dir):
    rows = _task(data_dir).train_rows
    tokenizer = make_char_tokenizer(string.printable)
    source = PromptSource(rows, field_columns=("answer",), chat_template=False,
                          max_prompt_len=20, batch_size=2)
    with pytest.raises(ValueError, match=r"all 6 prompts are longer than max_prompt_len=20"):
        source.build(tokenizer)


def test_eval_rows_are_the_held_out_split_rendered_like_training(data_dir):
    task = _task(data_dir, eval_split="test", fields=["id"], difficulty_column="level")
    assert list(task.train_rows["id"]) == [r["id"] for r in TRAIN]
    first = task.eval_rows(3, 0)
    assert first.column_names == task.train_rows.column_names
    assert list(first["prompt"]) == [gsm8k.render_question(r["question"]) for r in TEST[:3]]
    assert list(first["answer"]) == [r["answer"] for r in TEST[:3]]
    assert list(first["id"]) == [100, 101, 102]  # the first n, in dataset order
    assert first.to_list() == task.eval_rows(3, 7).to_list()  # whatever the seed
    assert len(task.eval_rows(50, 0)) == len(TEST)  # all of them when fewer
    with pytest.raises(ValueError, match="n must be >= 1"):
        task.eval_rows(0, 0)


def test_eval_rows_from_another_source(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", TRAIN)
    held_out = _jsonl(tmp_path / "held_out.jsonl", TEST)
    task = _task(train, eval_source=held_out, format="tags")
    rows = task.eval_rows(10, 0)
    assert [r["question"] for r in TEST] == [p.split("\n\n")[0] for p in rows["prompt"]]
    assert rows["prompt"][0] == gsm8k.render_question(TEST[0]["question"], "tags")


def test_a_held_out_split_that_is_not_there_fails_when_the_task_is_made(tmp_path, data_dir):
    with pytest.raises(ValueError, match=r"split 'validation' is not in .*data'; its splits "
                                         r"are \['train', 'test'\]"):
        _task(data_dir, eval_split="validation")
    held_out = _jsonl(tmp_path / "held_out.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match="answer column 'answer' is not in .*held_out.jsonl'"):
        _task(data_dir, eval_source=held_out)
