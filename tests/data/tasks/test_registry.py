"""Task registry: addition rows, tokenizer, device fields and reward; gsm8k rows from a file,
its rewards by format_weight, column errors; host fields of a reward set by dataset row."""

import json
import string
import typing

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.data.tasks import gsm8k
from jaxrl.data.tasks.addition import ALPHABET
from jaxrl.data.tasks.registry import TaskName, make_task
from jaxrl.data.tokenizer import make_char_tokenizer
from jaxrl.rl.rewards import JaxReward, PythonReward, RewardInputs

EOS = 2

# make_task's keyword arguments; each test overrides the ones it is about.
DEFAULTS = dict(source=None, prompt_column="question", answer_column="answer", num_digits=2,
                num_prompts=64, format_weight=0.0, seed=0)


def _task(name, **overrides):
    return make_task(name, **{**DEFAULTS, **overrides})


def _inputs(tokenizer, prompts, completions, rows, fields=None):
    """RewardInputs of right-padded completions and left-padded prompts, built by hand."""
    def pad(texts, left):
        encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        width = max(len(e) for e in encoded)
        ids = np.zeros((len(texts), width), np.int32)
        mask = np.zeros((len(texts), width), bool)
        for i, e in enumerate(encoded):
            cols = slice(width - len(e), width) if left else slice(0, len(e))
            ids[i, cols], mask[i, cols] = e, True
        return jnp.asarray(ids), jnp.asarray(mask)

    prompt_ids, prompt_mask = pad(prompts, left=True)
    completion_ids, completion_mask = pad(completions, left=False)
    return RewardInputs(prompt_ids, prompt_mask, completion_ids, completion_mask,
                        fields or {}, jnp.asarray(rows, jnp.int32))


# ------------------------------------------------------------------------------- addition


def test_addition_rows_are_prompt_and_answer_per_seed():
    rows = _task("addition", num_prompts=64, seed=0).train_rows
    assert set(rows.column_names) == {"prompt", "answer"} and len(rows) == 64
    for prompt, answer in zip(rows["prompt"], rows["answer"], strict=True):
        x, y = prompt.removesuffix("=").split("+")
        assert int(answer) == int(x) + int(y) and len(answer) == 3
    assert rows.to_list() == _task("addition", num_prompts=64, seed=0).train_rows.to_list()
    assert rows.to_list() != _task("addition", num_prompts=64, seed=1).train_rows.to_list()
    assert _task("addition").field_columns == ("answer",)


def test_addition_tokenizer_is_the_16_token_char_tokenizer():
    tokenizer = _task("addition").tokenizer()
    assert len(tokenizer) == 16
    assert tokenizer.convert_ids_to_tokens(list(range(4))) == ["<pad>", "<bos>", "<eos>",
                                                               "<unk>"]
    assert tokenizer.convert_tokens_to_ids(list(ALPHABET)) == list(range(4, 16))
    assert tokenizer.eos_token_id == EOS


def test_addition_device_fields_are_the_answer_digits_then_eos():
    task = _task("addition")
    tokenizer = task.tokenizer()
    target = task.device_fields(tokenizer, {"answer": ["132", "012"]})["target_ids"]
    # Digits follow the 4 specials: "0" is id 4, so digit d is id 4 + d.
    assert tokenizer.convert_tokens_to_ids(list("132")) == [5, 7, 6]
    expected = [[5, 7, 6, EOS], [4, 5, 6, EOS]]
    assert target.dtype == np.int32
    np.testing.assert_array_equal(target, expected)


def test_addition_reward_scores_by_digit():
    task = _task("addition")
    tokenizer = task.tokenizer()
    (reward,) = task.rewards(tokenizer)
    assert isinstance(reward, JaxReward) and reward.name == "addition" and reward.weight == 1.0
    fields = {k: jnp.asarray(v) for k, v in
              task.device_fields(tokenizer, {"answer": ["132", "132"]}).items()}
    # Against "132<eos>": row 0 is "132<eos>", all 4 right; row 1 is "199<eos>" ("9" is
    # id 13), right at "1" and "<eos>" only: 2 of 4.
    ids = jnp.asarray([[5, 7, 6, EOS], [5, 13, 13, EOS]], jnp.int32)
    mask = jnp.ones((2, 4), bool)
    inputs = RewardInputs(jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), bool), ids, mask,
                          fields, jnp.arange(2))
    np.testing.assert_allclose(reward.fn(inputs), [1.0, 0.5])


def test_addition_eval_rows_are_not_the_train_rows():
    task = _task("addition", num_prompts=50, seed=0)
    evals = task.eval_rows(50, 0)
    assert set(evals.column_names) == {"prompt", "answer"} and len(evals) == 50
    assert evals.to_list() == task.eval_rows(50, 0).to_list()
    assert evals["prompt"] != task.train_rows["prompt"]
    # Same eval seed as the train seed, still a different stream; another eval seed differs too.
    assert evals.to_list() != task.eval_rows(50, 1).to_list()


# ---------------------------------------------------------------------------------- gsm8k

QUESTIONS = ["What is 6 times 7?", "  Half of 1? \n", "How many legs have 3 cats?"]
ANSWERS = ["6 * 7 = 42\n#### 42", "#### 0.5", "3 * 4 = 12\n#### 12"]


@pytest.fixture
def gsm8k_file(tmp_path):
    def write(answer_column="answer", extra=None):
        path = tmp_path / "problems.jsonl"
        with path.open("w") as f:
            for q, a in zip(QUESTIONS, ANSWERS, strict=True):
                f.write(json.dumps({"question": q, answer_column: a, **(extra or {})}) + "\n")
        return str(path)
    return write


@pytest.mark.parametrize("answer_column", ["answer", "solution"])
def test_gsm8k_rows_are_the_rendered_question_and_the_answer(gsm8k_file, answer_column):
    task = _task("gsm8k", source=gsm8k_file(answer_column, extra={"id": 7}),
                 answer_column=answer_column)
    rows = task.train_rows
    assert sorted(rows.column_names) == ["answer", "prompt"]
    assert rows["prompt"] == [gsm8k.render_question(q) for q in QUESTIONS]
    assert rows["prompt"][1] == "Half of 1?" + gsm8k.PROMPT_SUFFIX
    assert rows["answer"] == ANSWERS
    assert task.field_columns == ("answer",)
    assert task.tokenizer is None and task.eval_rows is None
    assert task.device_fields(None, {"answer": ANSWERS}) == {}


@pytest.mark.parametrize("format_weight, expected", [
    (0.0, [("math", 1.0)]),
    (0.25, [("math", 1.0), ("format", 0.25)]),
])
def test_gsm8k_rewards_by_format_weight(gsm8k_file, format_weight, expected):
    task = _task("gsm8k", source=gsm8k_file(), format_weight=format_weight)
    rewards = task.rewards(None)
    assert all(isinstance(r, PythonReward) for r in rewards)
    assert [(r.name, r.weight) for r in rewards] == expected
    assert rewards[0].fn is gsm8k.math_reward
    if len(rewards) > 1:
        assert rewards[1].fn is gsm8k.format_reward


def test_gsm8k_missing_column_is_named(gsm8k_file):
    with pytest.raises(ValueError, match="'solution'"):
        _task("gsm8k", source=gsm8k_file(), answer_column="solution")
    with pytest.raises(ValueError, match="'problem'"):
        _task("gsm8k", source=gsm8k_file(), prompt_column="problem")


def test_gsm8k_needs_a_source():
    for source in (None, ""):
        with pytest.raises(ValueError, match="data.source"):
            _task("gsm8k", source=source)


def test_unknown_task_lists_the_valid_ones():
    assert typing.get_args(TaskName) == ("addition", "gsm8k")
    with pytest.raises(ValueError, match="unknown task 'sudoku'") as info:
        _task("sudoku")
    for name in typing.get_args(TaskName):
        assert name in str(info.value)


def test_reward_set_host_fields_follow_dataset_rows(gsm8k_file):
    task = _task("gsm8k", source=gsm8k_file(), format_weight=0.5)
    rows = task.train_rows
    tokenizer = make_char_tokenizer(string.printable)
    reward_set = task.reward_set(tokenizer, rows)
    assert reward_set.host_fields(np.array([2, 0, 0])) == [
        {"answer": ANSWERS[2]}, {"answer": ANSWERS[0]}, {"answer": ANSWERS[0]}]

    # Row 0's gold is 42, row 2's is 12: the same "\boxed{42}" is right for the first only.
    completions = ["So 6 * 7 = 42, \\boxed{42}", "the answer is \\boxed{42}", "#### 42"]
    inputs = _inputs(tokenizer, ["q0", "q2", "q0"], completions, rows=[0, 2, 0])
    values, errors = reward_set.score_host(inputs)
    np.testing.assert_array_equal(values, [[1.0, 0.0, 1.0],    # math
                                           [1.0, 1.0, 0.0]])   # format: one box
    np.testing.assert_array_equal(errors, [0, 0, 0])
    total, metrics = reward_set.score(inputs, (values, errors))
    np.testing.assert_allclose(total, [1.5, 0.5, 1.0])
    assert float(metrics["reward/math"]) == pytest.approx(2 / 3)
