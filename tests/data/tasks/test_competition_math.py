"""MATH task: gold from a solution's last box or a bare answer, the math_verify reward."""

import pytest

from jaxrl.data.tasks.competition_math import gold_answer, math_reward, render_problem
from jaxrl.data.tasks.formats import PROMPT_SUFFIXES

SOLUTION = ("The sum is $\\boxed{3}$ at first, but halving gives "
            "$\\boxed{\\frac{3}{2}}$.")


def test_render_problem_appends_the_format_instruction():
    assert render_problem(" Find $x$. ") == "Find $x$." + PROMPT_SUFFIXES["boxed"]
    assert render_problem("Find $x$.", "tags") == "Find $x$." + PROMPT_SUFFIXES["tags"]


@pytest.mark.parametrize("field, gold", [
    (SOLUTION, "\\frac{3}{2}"),  # a worked solution: its last box
    ("\\frac{3}{2}", "\\frac{3}{2}"),  # a bare answer: whole
    ("  (1, 2) \n", "(1, 2)"),
    ("#### 5", "#### 5"),  # "####" means nothing here
])
def test_gold_answer(field, gold):
    assert gold_answer(field) == gold


@pytest.mark.parametrize("field", ["", "  ", "\\boxed{}", "so \\boxed{ } it is", "\\boxed{5"])
def test_gold_answer_rejects_an_empty_answer_naming_the_value(field):
    with pytest.raises(ValueError, match="no answer in the answer field") as info:
        gold_answer(field)
    assert repr(field) in str(info.value)


@pytest.mark.parametrize("completion, field, format_, reward", [
    ("so \\boxed{1.5}", SOLUTION, "boxed", 1.0),
    ("so \\boxed{\\dfrac{3}{2}}", "\\frac{3}{2}", "boxed", 1.0),
    ("so \\boxed{3}", SOLUTION, "boxed", 0.0),
    ("<think>halve</think><answer>3/2</answer>", SOLUTION, "tags", 1.0),
    ("<think>halve</think><answer>3</answer>", SOLUTION, "tags", 0.0),
    ("\\boxed{\\frac{3}{2}}", SOLUTION, "tags", 0.0),
    ("", SOLUTION, "boxed", 0.0),
])
def test_math_reward(completion, field, format_, reward):
    value = math_reward("p", completion, {"answer": field}, answer_format=format_)
    assert isinstance(value, float) and value == reward


def test_math_reward_missing_answer_field_names_it():
    with pytest.raises(KeyError, match="'answer'"):
        math_reward("p", "\\boxed{1}", {"solution": SOLUTION})
