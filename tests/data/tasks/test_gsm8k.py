"""GSM8K task: gold and final-answer extraction, the math_verify reward (also off the main
thread), the format reward."""

import threading
import time

import pytest

from jaxrl.data.tasks import gsm8k
from jaxrl.data.tasks.gsm8k import (
    PROMPT_SUFFIX,
    final_answer,
    format_reward,
    gold_answer,
    math_reward,
    render_question,
)

GSM8K_ANSWER = ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
                "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 1,234")


def test_render_question_appends_the_boxed_instruction():
    prompt = render_question("  How many eggs?\n")
    assert prompt == "How many eggs?" + PROMPT_SUFFIX
    assert "\\boxed{" in PROMPT_SUFFIX


@pytest.mark.parametrize("field, gold", [
    (GSM8K_ANSWER, "1234"),
    ("72", "72"),
    ("  72 \n", "72"),
    ("x #### 1 #### -3", "-3"),
    ("#### 1,234,567", "1234567"),
    ("#### 0.5", "0.5"),
])
def test_gold_answer(field, gold):
    assert gold_answer(field) == gold


@pytest.mark.parametrize("field", ["", "   ", "worked solution ####  \n"])
def test_gold_answer_rejects_an_empty_answer_naming_the_value(field):
    with pytest.raises(ValueError, match="no answer in the answer field") as info:
        gold_answer(field)
    assert repr(field) in str(info.value)


@pytest.mark.parametrize("completion, answer", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{\\text{a {b} c}}", "\\text{a {b} c}"),
    ("first \\boxed{3}, no wait: \\boxed{4}", "4"),
    # An unclosed last box (a truncated completion) is no box; the earlier one counts.
    ("\\boxed{5} then \\boxed{6", "5"),
    ("\\boxed{} blank, but \\boxed{ 7 }", "7"),
    # A box wins over "####" wherever they are.
    ("\\boxed{8}\n#### 9", "8"),
    ("2 + 2 = 4\n#### 4\nthat is all", "4"),
    ("#### 1\n#### 12 apples \nmore", "12 apples"),
])
def test_final_answer(completion, answer):
    assert final_answer(completion) == answer


@pytest.mark.parametrize("completion", ["", "the answer is 42", "\\boxed{}", "\\boxed{42",
                                        "####\n42", "#### "])
def test_final_answer_none_without_an_answer(completion):
    assert final_answer(completion) is None


@pytest.mark.parametrize("completion, gold, reward", [
    ("\\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{\\frac{1}{2}}", "#### 0.5", 1.0),
    ("\\boxed{72}", "72", 1.0),
    ("\\boxed{72.0}", "72", 1.0),
    ("\\boxed{\\$72}", "72", 1.0),
    ("\\boxed{1,234}", GSM8K_ANSWER, 1.0),
    ("she earns 18 dollars\n#### 18", "He earns 18 a day.\n#### 18", 1.0),
    ("\\boxed{71}", "72", 0.0),
    ("\\boxed{72} no, \\boxed{71}", "72", 0.0),
    ("the answer is 72", "72", 0.0),
    ("", "72", 0.0),
])
def test_math_reward(completion, gold, reward):
    value = math_reward("prompt", completion, {"answer": gold})
    assert isinstance(value, float)
    assert value == reward


def test_math_reward_works_off_the_main_thread():
    # math_verify's default signal timeouts raise ValueError outside the main thread.
    results, errors = [], []

    def run():
        try:
            results.append(math_reward("p", "\\boxed{\\frac{1}{2}}", {"answer": "0.5"}))
            results.append(math_reward("p", "\\boxed{3}", {"answer": "0.5"}))
        except Exception as e:  # asserted on below, in the main thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert errors == []
    assert results == [1.0, 0.0]


@pytest.mark.parametrize("completion", ["\\boxed{72}", "no answer at all"])
def test_math_reward_missing_answer_field_raises_key_error_naming_it(completion):
    with pytest.raises(KeyError, match="'answer'") as info:
        math_reward("prompt", completion, {"question": "q"})
    assert "question" in str(info.value)


@pytest.mark.parametrize("completion, reward", [
    ("so \\boxed{\\frac{1}{2}}", 1.0),
    ("\\boxed{\\boxed{3}}", 1.0),
    ("\\boxed{} and \\boxed{4}", 1.0),
    ("\\boxed{3} or \\boxed{4}", 0.0),
    ("#### 4", 0.0),
    ("\\boxed{4", 0.0),
    ("", 0.0),
])
def test_format_reward(completion, reward):
    assert format_reward("prompt", completion, {}) == reward


def test_math_reward_bounds_a_pathological_answer_on_the_main_thread(monkeypatch):
    # Verifying a power tower against 72 does not finish in minutes; the timeout scores it 0.
    monkeypatch.setattr(gsm8k, "TIMEOUT_S", 1)
    start = time.perf_counter()
    assert gsm8k.math_reward("", r"\boxed{9^{9^{9^{9}}}}", {"answer": "72"}) == 0.0
    assert time.perf_counter() - start < 30
