"""Addition task: problems per seed, correct zero-padded sums, token round trip, the reward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.data.tasks.addition import (
    ADDITION_ALPHABET,
    AdditionTask,
    addition_reward,
    exact_match,
    held_out,
    make_addition_tokenizer,
)
from jaxrl.data.tokenizer import decode_completions, encode_prompts, load_tokenizer

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def tokenizer():
    return make_addition_tokenizer()


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_problems_are_deterministic_per_seed_and_differ_across_seeds():
    task = AdditionTask()
    assert task.sample_problems(64, seed=0) == task.sample_problems(64, seed=0)
    assert task.sample_problems(64, seed=0) != task.sample_problems(64, seed=1)
    # A longer draw extends a shorter one with the same seed.
    assert task.sample_problems(64, seed=3)[:10] == task.sample_problems(10, seed=3)


@pytest.mark.parametrize("num_digits", [1, 2, 3])
def test_answers_are_zero_padded_sums(num_digits):
    problems = AdditionTask(num_digits).sample_problems(500, seed=7)
    for p in problems:
        x, y = p["prompt"].removesuffix("=").split("+")
        assert len(x) == len(y) == num_digits and p["prompt"].endswith("=")
        assert len(p["answer"]) == num_digits + 1
        assert int(p["answer"]) == int(x) + int(y)
    operands = [int(s) for p in problems for s in p["prompt"][:-1].split("+")]
    # Uniform over [0, 10^n): small and leading-zero operands occur.
    assert min(operands) < 10 ** (num_digits - 1) and max(operands) < 10**num_digits
    assert set("".join(p["prompt"] for p in problems)) <= set(ADDITION_ALPHABET)


def test_worked_examples_are_formatted_as_documented(tokenizer):
    task = AdditionTask()
    target = task.answer_token_ids(tokenizer, ["132", "046"])
    assert target.shape == (2, 4) and target.dtype == np.int32
    assert tokenizer.decode(target[0]) == "132<eos>"
    assert tokenizer.decode(target[1], skip_special_tokens=True) == "046"
    assert target[:, -1].tolist() == [EOS, EOS]


def test_token_ids_round_trip_through_the_saved_tokenizer(tmp_path):
    make_addition_tokenizer().save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer) == 4 + len(ADDITION_ALPHABET)
    task = AdditionTask(3)
    problems = task.sample_problems(16, seed=0)
    target = task.answer_token_ids(tokenizer, [p["answer"] for p in problems])
    texts = decode_completions(tokenizer, target, np.ones_like(target, bool))
    assert texts == [p["answer"] for p in problems]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [p["prompt"] for p in problems],
                                             chat_template=False)
    # Zero-padded operands: every prompt is 2n+2 tokens, so none is left-padded.
    assert prompt_ids.shape == (16, 2 * 3 + 2) and prompt_mask.all()
    assert tokenizer.decode(prompt_ids[0], skip_special_tokens=True) == problems[0]["prompt"]


def test_bad_arguments_are_named(tokenizer):
    with pytest.raises(ValueError, match="num_digits"):
        AdditionTask(0)
    with pytest.raises(ValueError, match="n must be"):
        AdditionTask().sample_problems(0, seed=0)
    with pytest.raises(ValueError, match="is not 3 digits"):
        AdditionTask().answer_token_ids(tokenizer, ["46"])
    with pytest.raises(ValueError, match="vocab_size"):
        AdditionTask().chance_reward(1)


def completions(tokenizer, texts, width):
    """Right-padded completion ids and masks from texts, '$' standing for EOS."""
    ids_BxC = np.full((len(texts), width), PAD, np.int32)
    mask_BxC = np.zeros((len(texts), width), bool)
    for row, text in enumerate(texts):
        row_ids = [EOS if ch == "$" else ids(tokenizer, ch)[0] for ch in text]
        ids_BxC[row, :len(row_ids)] = row_ids
        mask_BxC[row, :len(row_ids)] = True
    return jnp.asarray(ids_BxC), jnp.asarray(mask_BxC)


CASES = [  # (completion, reward) against target "132<eos>", A = 4
    ("132$", 1.0),              # all right
    ("9045", 0.0),              # all wrong
    ("142$", 0.75),             # one digit wrong: (A-1)/A
    ("1320", 0.75),             # right digits, no EOS
    ("132", 0.75),              # right digits, then stopped by the budget (mask 0)
    ("132$7+", 1.0),            # longer than A with a correct prefix
    ("1$", 0.25),               # short: missing positions are wrong
    ("", 0.0),                  # empty
    ("$132", 0.0),              # shifted by one
]


def test_reward_on_hand_made_completions(tokenizer):
    target = AdditionTask().answer_token_ids(tokenizer, ["132"] * len(CASES))
    ids_BxC, mask_BxC = completions(tokenizer, [c for c, _ in CASES], width=8)
    reward = addition_reward(ids_BxC, mask_BxC, jnp.asarray(target))
    assert reward.dtype == jnp.float32
    np.testing.assert_allclose(reward, [r for _, r in CASES])
    assert exact_match(ids_BxC, mask_BxC, target).tolist() == [r == 1.0 for _, r in CASES]


def test_masked_tokens_never_score(tokenizer):
    target = AdditionTask().answer_token_ids(tokenizer, ["132"])
    ids_BxC, _ = completions(tokenizer, ["132$"], width=4)
    mask_BxC = jnp.array([[True, False, True, True]])
    np.testing.assert_allclose(addition_reward(ids_BxC, mask_BxC, target), [0.75])
    assert not exact_match(ids_BxC, mask_BxC, target)[0]


def test_completion_narrower_than_the_target(tokenizer):
    target = AdditionTask().answer_token_ids(tokenizer, ["132", "046"])
    ids_BxC, mask_BxC = completions(tokenizer, ["13", "04"], width=2)
    np.testing.assert_allclose(addition_reward(ids_BxC, mask_BxC, target), [0.5, 0.5])
    assert not exact_match(ids_BxC, mask_BxC, target).any()


def test_jit_matches_eager(tokenizer):
    task = AdditionTask()
    rng = np.random.default_rng(0)
    problems = task.sample_problems(32, seed=0)
    target = jnp.asarray(task.answer_token_ids(tokenizer, [p["answer"] for p in problems]))
    # Half the rows right, the rest random tokens with random lengths.
    ids_BxC = rng.integers(0, len(tokenizer), size=(32, 6)).astype(np.int32)
    ids_BxC[:16, :4] = target[:16]
    mask_BxC = np.arange(6)[None, :] < rng.integers(0, 7, size=(32, 1))
    mask_BxC[:16] = True
    args = (jnp.asarray(ids_BxC), jnp.asarray(mask_BxC), target)
    eager = addition_reward(*args)
    np.testing.assert_array_equal(jax.jit(addition_reward)(*args), eager)
    np.testing.assert_array_equal(jax.jit(exact_match)(*args), exact_match(*args))
    assert (eager[:16] == 1).all() and (exact_match(*args) == (eager == 1)).all()


def test_chance_reward_matches_a_uniform_policy_that_stops_at_eos(tokenizer):
    task = AdditionTask()
    vocab = len(tokenizer)
    assert task.chance_reward(vocab) == pytest.approx((1 - (1 - 1 / vocab) ** 4) / 4)
    n, width = 40_000, 6
    rng = np.random.default_rng(0)
    problems = task.sample_problems(n, seed=1)
    target = task.answer_token_ids(tokenizer, [p["answer"] for p in problems])
    ids_BxC = rng.integers(0, vocab, size=(n, width)).astype(np.int32)
    # The sampler keeps the first EOS in the mask and masks everything after it.
    is_eos = ids_BxC == EOS
    mask_BxC = np.cumsum(is_eos, axis=1) - is_eos == 0
    reward = np.asarray(jax.jit(addition_reward)(ids_BxC, mask_BxC, target))
    standard_error = reward.std() / np.sqrt(n)
    assert abs(reward.mean() - task.chance_reward(vocab)) < 4 * standard_error


def test_evaluation_problems_are_held_out_from_training_and_distinct():
    task = AdditionTask(2)
    train = {p["prompt"] for p in task.sample_problems(50_000, seed=0)}
    evaluation = [p["prompt"] for p in task.sample_problems(1000, seed=0, split="eval")]
    assert len(set(evaluation)) == 1000 and not train & set(evaluation)
    x, y = np.divmod(np.arange(10**4), 100)
    held = held_out(x, y)
    assert 900 <= held.sum() <= 1100  # about a tenth
    # Training draws only problems that are not held out, and reaches nearly all of them
    # (50,000 uniform draws over ~9,000 problems leave about e^-5.6 of them unseen).
    allowed = {f"{a:02d}+{b:02d}=" for a, b, h in zip(x, y, held, strict=True) if not h}
    assert train <= allowed and len(train) > 0.99 * len(allowed)
    # One digit: 100 problems, about 10 held out; asking for more gives all of them.
    small = AdditionTask(1).sample_problems(50, seed=0, split="eval")
    x1, y1 = np.divmod(np.arange(100), 10)
    assert len(small) == held_out(x1, y1).sum() == len({p["prompt"] for p in small})
    with pytest.raises(ValueError, match="split must be one of"):
        task.sample_problems(3, seed=0, split="test")
