"""Task config: what is checked before any data is read (each error naming the key), the
held-out rows it points at, and the data section's curriculum check."""

import typing

import pytest

from jaxrl.data.section import DataSection, TaskName

GSM8K = dict(task="gsm8k", source="openai/gsm8k", subset="main")


def test_task_names():
    assert typing.get_args(TaskName) == ("addition", "tool_multiplication", "gsm8k", "math",
                                         "custom")
    with pytest.raises(ValueError, match="unknown task 'sudoku'") as info:
        DataSection(task="sudoku")
    for name in typing.get_args(TaskName):
        assert name in str(info.value)


@pytest.mark.parametrize("key, value", [
    ("source", "rows.jsonl"), ("subset", "main"), ("split", "test"), ("eval_split", "test"),
    ("eval_source", "eval.jsonl"), ("fields", ["level"]), ("difficulty_column", "level"),
    ("format", "tags"), ("format_weight", 0.5), ("reward_fn", "pkg:fn"),
])
def test_addition_rejects_every_dataset_key(key, value):
    with pytest.raises(ValueError, match=f"data.{key} must be .* for data.task=addition") as info:
        DataSection(**{key: value})
    assert f"got {value!r}; for a dataset, set data.task to one of gsm8k, math, custom" in str(
        info.value)


def test_dataset_tasks_need_a_source_and_custom_a_reward_fn():
    for task in ("gsm8k", "math", "custom"):
        with pytest.raises(ValueError, match=f"data.source must name the prompts of "
                                             f"data.task={task}"):
            DataSection(task=task, reward_fn="pkg:fn")
    with pytest.raises(ValueError, match="data.reward_fn"):
        DataSection(task="custom", source="rows.jsonl")
    assert DataSection(task="custom", source="rows.jsonl", reward_fn="pkg:fn").fields == []


@pytest.mark.parametrize("keys, message", [
    (dict(fields=["level", "level"]), r"distinct columns, got \['level', 'level'\]"),
    (dict(fields=["prompt"]), "must not hold 'prompt'"),
    (dict(fields=["answer"]), "must not hold 'answer' for data.task=gsm8k"),
    (dict(split=""), "data.split must be a non-empty name"),
    (dict(prompt_column=""), "data.prompt_column must be a non-empty name"),
    (dict(format_weight=-0.5), "data.format_weight must be a finite number >= 0"),
    (dict(format_weight=float("nan")), "data.format_weight must be a finite number >= 0"),
    (dict(format="xml"), "data.format must be one of boxed, tags, got 'xml'"),
    (dict(eval_split="train"), r"name the training rows \('openai/gsm8k' split 'train'\)"),
    (dict(eval_source="openai/gsm8k"), "name the training rows"),
    (dict(eval_source="openai/gsm8k", subset=None), "name the training rows"),
    (dict(num_prompts=0), "data.num_prompts must be >= 1, got 0"),
    (dict(reward_bounds=[1, -1]),
     r"data.reward_bounds must be two finite numbers \[low, high\] with low < high, got"),
])
def test_bad_keys_are_named(keys, message):
    with pytest.raises(ValueError, match=message):
        DataSection(**{**GSM8K, **keys})


def test_custom_may_carry_an_answer_field():
    config = DataSection(task="custom", source="rows.jsonl", reward_fn="pkg:fn",
                        fields=["answer"])
    assert config.fields == ["answer"]


def test_held_out_rows_default_to_the_training_source_and_split_name():
    assert DataSection(**GSM8K).held_out() is None
    assert DataSection(**GSM8K, eval_split="test").held_out() == ("openai/gsm8k", "main", "test")
    # A separate source has no subset (it belongs to the training source); its split is the
    # training split's name unless given.
    assert DataSection(**GSM8K, eval_source="eval.jsonl").held_out() == ("eval.jsonl", None,
                                                                        "train")
    assert DataSection(**GSM8K, eval_source="org/other", eval_split="test").held_out() == (
        "org/other", None, "test")
    assert DataSection(**GSM8K, eval_source="openai/gsm8k", eval_split="test").held_out() == (
        "openai/gsm8k", "main", "test")


def test_data_section_adds_batching_and_the_curriculum():
    assert DataSection().curriculum == "none"
    assert DataSection(curriculum="pass_rate").curriculum == "pass_rate"
    with pytest.raises(ValueError, match="data.curriculum=ordered .* data.difficulty_column"):
        DataSection(**GSM8K, curriculum="ordered")
    section = DataSection(**GSM8K, curriculum="ordered", difficulty_column="level")
    assert isinstance(section, DataSection) and section.difficulty_column == "level"
    with pytest.raises(ValueError, match="data.batch_size must be >= 1"):
        DataSection(batch_size=0)
    with pytest.raises(ValueError, match="data.source must be null for data.task=addition"):
        DataSection(source="rows.jsonl")
