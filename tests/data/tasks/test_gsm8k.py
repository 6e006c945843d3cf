"""GSM8K task: the prompt per answer format, gold extraction, the math_verify reward in both
answer formats."""

import pytest

from jaxrl.data.tasks.formats import PROMPT_SUFFIXES
from jaxrl.data.tasks.gsm8k import gold_answer, math_reward, render_question

GSM8K_ANSWER = ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
                "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 1,234")


def test_render_question_appends_the_format_instruction():
    assert render_question("  How many eggs?\n") == "How many eggs?" + PROMPT_SUFFIXES["boxed"]
    assert render_question("How many eggs?", "tags") == "How many eggs?" + PROMPT_SUFFIXES["tags"]


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


@pytest.mark.parametrize("completion, gold, reward", [
    ("\\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{\\frac{1}{2}}", "#### 0.5", 1.0),
    ("\\boxed{72.0}", "72", 1.0),
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


@pytest.mark.parametrize("completion, reward", [
    ("<think>6 * 7</think><answer>42</answer>", 1.0),
    ("<think>6 * 7</think><answer>so \\boxed{42}</answer>", 1.0),
    ("<think>6 * 7</think><answer>41</answer>", 0.0),
    # The tags format reads only the answer block: a box outside it is no answer.
    ("6 * 7 = \\boxed{42}", 0.0),
    ("<answer>42</answer> \\boxed{41}", 1.0),
])
def test_math_reward_in_the_tags_format(completion, reward):
    assert math_reward("p", completion, {"answer": "#### 42"}, answer_format="tags") == reward


@pytest.mark.parametrize("completion", ["\\boxed{72}", "no answer at all"])
def test_math_reward_missing_answer_field_raises_key_error_naming_it(completion):
    with pytest.raises(KeyError, match="'answer'") as info:
        math_reward("prompt", completion, {"question": "q"})
    assert "question" in str(info.value)
