"""Task registry: addition rows, tokenizer, device fields and reward; the dataset tasks' rows
and rewards by task, answer format, format weight and reward_fn (resolved before any data is
read); host fields of a reward set by dataset row."""

import json
import string
import uuid

import datasets
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import DataSection
from jaxrl.data.tasks import competition_math, formats, gsm8k
from jaxrl.data.tasks.addition import ADDITION_ALPHABET
from jaxrl.data.tasks.registry import make_task
from jaxrl.data.tokenizer import make_char_tokenizer
from jaxrl.rl.rewards import JaxReward, PythonReward, RewardInputs

EOS = 2



def _task(name, seed=0, **keys):
    """make_task of data.task=name; dataset tasks read the "question" column unless told."""
    if name == "addition":
        keys.setdefault("num_prompts", 64)
    else:
        keys.setdefault("prompt_column", "question")
    return make_task(DataSection(task=name, **keys), seed=seed)


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
    assert tokenizer.convert_tokens_to_ids(list(ADDITION_ALPHABET)) == list(range(4, 16))
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


# ------------------------------------------------------------------------- dataset tasks

QUESTIONS = ["What is 6 times 7?", "  Half of 1? \n", "How many legs have 3 cats?"]
ANSWERS = ["6 * 7 = 42\n#### 42", "#### 0.5", "3 * 4 = 12\n#### 12"]
SOLUTIONS = ["6 * 7 is $\\boxed{42}$.", "Half is $\\boxed{\\frac{1}{2}}$.", "$\\boxed{12}$"]
LEVELS = [1, 3, 2]


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


@pytest.fixture
def problems(tmp_path):
    """A jsonl of QUESTIONS with their ANSWERS (or SOLUTIONS), levels and an id."""
    path = tmp_path / "problems.jsonl"
    with path.open("w") as f:
        for i, (q, a, s, level) in enumerate(zip(QUESTIONS, ANSWERS, SOLUTIONS, LEVELS,
                                                 strict=True)):
            f.write(json.dumps({"question": q, "answer": a, "solution": s, "level": level,
                                "id": i}) + "\n")
    return str(path)


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A module on sys.path with the reward `score`: 1 when the completion holds fields["id"]."""
    name = f"jaxrl_test_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "def score(prompt, completion, fields):\n"
        "    return float(str(fields.get('id')) in completion)\n"
        "mean = score\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_gsm8k_rows_are_the_rendered_question_and_the_answer(problems):
    task = _task("gsm8k", source=problems)
    rows = task.train_rows
    assert rows.column_names == ["prompt", "answer"]
    assert list(rows["prompt"]) == [gsm8k.render_question(q) for q in QUESTIONS]
    assert rows["prompt"][1] == "Half of 1?" + formats.PROMPT_SUFFIXES["boxed"]
    assert list(rows["answer"]) == ANSWERS
    assert task.name == "gsm8k" and task.field_columns == ("answer",)
    assert task.tokenizer is None and task.eval_rows is None and task.difficulty_column is None
    assert task.device_fields(None, {"answer": ANSWERS}) == {}


def test_fields_and_difficulty_are_carried(problems):
    task = _task("gsm8k", source=problems, answer_column="solution", fields=["id", "solution"],
                 difficulty_column="level")
    rows = task.train_rows
    assert rows.column_names == ["prompt", "answer", "id", "solution", "level"]
    assert list(rows["answer"]) == list(rows["solution"]) == SOLUTIONS
    assert list(rows["id"]) == [0, 1, 2] and list(rows["level"]) == LEVELS
    assert task.field_columns == ("answer", "id", "solution")
    assert task.difficulty_column == "level"


@pytest.mark.parametrize("name, format_weight, expected", [
    ("gsm8k", 0.0, [("math", 1.0)]),
    ("gsm8k", 0.25, [("math", 1.0), ("format", 0.25)]),
    ("math", 0.5, [("math", 1.0), ("format", 0.5)]),
])
def test_math_task_rewards_by_format_weight(problems, name, format_weight, expected):
    task = _task(name, source=problems, format_weight=format_weight)
    rewards = task.rewards(None)
    assert all(isinstance(r, PythonReward) for r in rewards)
    assert [(r.name, r.weight) for r in rewards] == expected
    module = {"gsm8k": gsm8k, "math": competition_math}[name]
    assert rewards[0].fn is module.math_reward
    if len(rewards) > 1:
        assert rewards[1].fn is formats.format_reward


def test_the_tags_format_asks_for_tags_and_reads_the_answer_block(problems):
    task = _task("gsm8k", source=problems, format="tags", format_weight=0.5)
    assert task.train_rows["prompt"][0] == QUESTIONS[0] + formats.PROMPT_SUFFIXES["tags"]
    math, fmt = task.rewards(None)
    fields = {"answer": ANSWERS[0]}
    tagged, boxed = "<think>6 * 7</think><answer>42</answer>", "so \\boxed{42}"
    assert (math.fn("p", tagged, fields), math.fn("p", boxed, fields)) == (1.0, 0.0)
    assert (fmt.fn("p", tagged, fields), fmt.fn("p", boxed, fields)) == (1.0, 0.0)


def test_math_task_gold_is_the_last_box_of_the_solution(problems):
    task = _task("math", source=problems, answer_column="solution")
    rows = task.train_rows
    assert rows["prompt"][1] == competition_math.render_problem(QUESTIONS[1])
    (math,) = task.rewards(None)
    assert [math.fn("p", "\\boxed{0.5}", {"answer": a}) for a in rows["answer"]] == [0, 1, 0]


def test_custom_prompts_are_verbatim_and_scored_by_reward_fn(problems, reward_module):
    task = _task("custom", source=problems, fields=["id"], reward_fn=f"{reward_module}:score",
                 format="tags", format_weight=0.25)
    rows = task.train_rows
    assert rows.column_names == ["prompt", "id"]
    assert list(rows["prompt"]) == QUESTIONS  # not stripped, no instruction
    assert task.field_columns == ("id",)
    score, fmt = task.rewards(None)
    assert (score.name, score.weight, fmt.name, fmt.weight) == ("score", 1.0, "format", 0.25)
    assert score.fn("p", "row 2", {"id": 2}) == 1.0 and score.fn("p", "row 1", {"id": 2}) == 0.0
    assert fmt.fn("p", "<think>x</think><answer>2</answer>", {}) == 1.0


def test_reward_fn_replaces_the_correctness_reward(problems, reward_module):
    # The gold answers are not read, so answers math-verify could not use are fine here.
    path = problems.replace("problems", "odd")
    with open(path, "w") as f:
        f.write(json.dumps({"question": "q", "answer": "", "id": 7}) + "\n")
    task = _task("gsm8k", source=path, fields=["id"], reward_fn=f"{reward_module}:score",
                 format_weight=0.5)
    assert [r.name for r in task.rewards(None)] == ["score", "format"]
    assert task.field_columns == ("answer", "id")


def test_reward_fn_is_resolved_before_any_data_is_read(tmp_path, reward_module):
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="data.reward_fn='jaxrl_nope:score': module"):
        _task("custom", source=missing, reward_fn="jaxrl_nope:score")
    with pytest.raises(ValueError, match=r"data.reward_fn=.*:mean': .*clashes with the metric"):
        _task("gsm8k", source=missing, reward_fn=f"{reward_module}:mean")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        _task("custom", source=missing, reward_fn=f"{reward_module}:score")


def test_a_reward_fn_named_format_clashes_with_the_format_reward(problems, tmp_path,
                                                                monkeypatch):
    (tmp_path / "jaxrl_test_format_reward.py").write_text("def format(p, c, f):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    keys = dict(source=problems, reward_fn="jaxrl_test_format_reward:format")
    assert [r.name for r in _task("custom", **keys).rewards(None)] == ["format"]
    with pytest.raises(ValueError, match="named 'format' like the format reward"):
        _task("custom", **keys, format_weight=1.0)


def test_reward_bounds_are_the_declared_range_of_the_reward_fn(problems, tmp_path, monkeypatch):
    """data.reward_bounds=[-1, 1]: the reward_fn's -0.5 is a value; with the default [0, 1]
    the same -0.5 is a failed call (NaN, counted in the errors)."""
    (tmp_path / "jaxrl_test_penalty_reward.py").write_text(
        "def penalty(prompt, completion, fields):\n"
        "    return -0.5 if len(completion) % 2 else 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    keys = dict(source=problems, reward_fn="jaxrl_test_penalty_reward:penalty")
    tokenizer = make_char_tokenizer(string.printable)
    inputs = _inputs(tokenizer, ["q0", "q1"], ["odd", "even"], rows=[0, 1])
    wide = _task("custom", **keys, reward_bounds=[-1, 1])
    assert [r.bounds for r in wide.rewards(None)] == [(-1.0, 1.0)]
    values, errors = wide.reward_set(tokenizer, wide.train_rows).score_host(inputs)
    assert values.tolist() == [[-0.5, 0.5]] and errors.tolist() == [0, 0]
    default = _task("custom", **keys)
    values, errors = default.reward_set(tokenizer, default.train_rows).score_host(inputs)
    assert np.isnan(values[0, 0]) and values[0, 1] == 0.5 and errors.tolist() == [1, 0]


def test_reward_set_host_fields_follow_dataset_rows(problems):
    task = _task("gsm8k", source=problems, format_weight=0.5)
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
