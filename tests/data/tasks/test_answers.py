"""Math answers: boxed and "####" extraction, thousands separators, math-verify equality (also
off the main thread, and bounded on it)."""

import threading
import time

import pytest

from jaxrl.data.tasks import answers
from jaxrl.data.tasks.answers import (
    after_hashes,
    answer_field,
    boxed_answer,
    boxed_contents,
    drop_thousands_separators,
    equal,
)


@pytest.mark.parametrize("text, contents", [
    ("so \\boxed{\\frac{1}{2}}.", ["\\frac{1}{2}"]),
    ("\\boxed{\\text{a {b} c}}", ["\\text{a {b} c}"]),
    ("\\boxed{3} or \\boxed{ 4 }", ["3", "4"]),
    ("\\boxed{\\boxed{3}}", ["\\boxed{3}"]),  # top level only
    ("\\boxed{} blank, \\boxed{  }", []),
    ("\\boxed{5} then \\boxed{6", ["5"]),  # an unclosed box is none
    ("\\boxed{6", []),
    ("no box", []),
])
def test_boxed_contents(text, contents):
    assert boxed_contents(text) == contents


@pytest.mark.parametrize("completion, answer", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
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
    assert boxed_answer(completion) == answer


@pytest.mark.parametrize("completion", ["", "the answer is 42", "\\boxed{}", "\\boxed{42",
                                        "####\n42", "#### "])
def test_final_answer_none_without_an_answer(completion):
    assert boxed_answer(completion) is None
    assert after_hashes(completion) is None


@pytest.mark.parametrize("text, out", [
    ("1,234", "1234"), ("1,234,567", "1234567"), ("1,23", "1,23"), ("a, b", "a, b"),
    ("(1,2345)", "(1,2345)"),
])
def test_drop_thousands_separators(text, out):
    assert drop_thousands_separators(text) == out


@pytest.mark.parametrize("gold, answer, value", [
    ("1/2", "0.5", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),
    ("72", "72.0", 1.0),
    ("72", "\\$72", 1.0),
    ("72", "71", 0.0),
    ("72", None, 0.0),
])
def test_equal(gold, answer, value):
    result = equal(gold, answer)
    assert isinstance(result, float) and result == value


def test_answer_field_names_the_fields_a_row_has():
    assert answer_field({"answer": 72}) == "72"
    with pytest.raises(KeyError, match="'answer'") as info:
        answer_field({"question": "q"})
    assert "question" in str(info.value)


def test_equal_works_off_the_main_thread():
    # math_verify's default signal timeouts raise ValueError outside the main thread.
    results, errors = [], []

    def run():
        try:
            results.append(equal("0.5", "\\frac{1}{2}"))
            results.append(equal("0.5", "3"))
        except Exception as e:  # asserted on below, in the main thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert errors == []
    assert results == [1.0, 0.0]


def test_equal_bounds_a_pathological_answer_on_the_main_thread(monkeypatch):
    # Verifying a power tower against 72 does not finish in minutes; the timeout scores it 0.
    monkeypatch.setattr(answers, "TIMEOUT_S", 1)
    start = time.perf_counter()
    assert equal("72", "9^{9^{9^{9}}}") == 0.0
    assert time.perf_counter() - start < 30
