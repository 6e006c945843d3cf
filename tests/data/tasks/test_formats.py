"""Answer formats: the instruction each asks for, where the final answer is, the format
reward on hand-made completions."""

import functools

import pytest

from jaxrl.data.tasks.formats import PROMPT_SUFFIXES, final_answer, format_reward, instruct


def test_instruct_appends_the_format_instruction():
    assert instruct("  How many eggs?\n", "boxed") == "How many eggs?" + PROMPT_SUFFIXES["boxed"]
    assert "\\boxed{" in PROMPT_SUFFIXES["boxed"]
    tags = instruct("How many eggs?", "tags")
    assert tags.startswith("How many eggs?\n\n")
    assert "<think> </think>" in tags and "<answer> </answer>" in tags
    with pytest.raises(ValueError, match="'xml'"):
        instruct("q", "xml")


@pytest.mark.parametrize("completion, answer", [
    ("<think>2+2</think><answer>4</answer>", "4"),
    ("<think>x</think>\n<answer> \\frac{1}{2} </answer>", "\\frac{1}{2}"),
    # A box inside the answer block wins; the text around it does not count.
    ("<think>x</think><answer>it is \\boxed{7} apples</answer>", "7"),
    # The last complete answer block counts; an unclosed one does not.
    ("<answer>1</answer> <answer>2</answer> <answer>3", "2"),
    # Without tags there is no answer, boxed or not.
    ("the answer is \\boxed{4}", None),
    ("#### 4", None),
    ("<think>x</think><answer>  </answer>", None),
    ("<think>x</think><answer>\\boxed{}</answer>", "\\boxed{}"),
])
def test_tags_final_answer(completion, answer):
    assert final_answer(completion, "tags") == answer


def test_boxed_final_answer_ignores_tags():
    assert final_answer("<answer>5</answer> so \\boxed{7}", "boxed") == "7"
    assert final_answer("<answer>5</answer>", "boxed") is None


@pytest.mark.parametrize("completion, reward", [
    ("so \\boxed{\\frac{1}{2}}", 1.0),
    ("\\boxed{\\boxed{3}}", 1.0),
    ("\\boxed{} and \\boxed{4}", 1.0),
    ("\\boxed{3} or \\boxed{4}", 0.0),
    ("#### 4", 0.0),
    ("\\boxed{4", 0.0),
    ("", 0.0),
])
def test_boxed_format_reward(completion, reward):
    assert format_reward("prompt", completion, {}) == reward
    assert format_reward("prompt", completion, {}, answer_format="boxed") == reward


@pytest.mark.parametrize("completion, reward", [
    ("<think>2 + 2 = 4</think><answer>4</answer>", 1.0),
    ("  \n<think>\nmulti\nline\n</think>\n\n<answer> 4 </answer>\n", 1.0),
    ("<think></think><answer>4</answer>", 1.0),  # an empty think block is one block
    ("<think>x</think><answer>\\boxed{4}</answer>", 1.0),
    ("<think>x</think><answer> </answer>", 0.0),  # blank answer
    ("<answer>4</answer>", 0.0),  # no think block
    ("<think>x</think>", 0.0),  # no answer block
    ("<answer>4</answer><think>x</think>", 0.0),  # wrong order
    ("so <think>x</think><answer>4</answer>", 0.0),  # text before
    ("<think>x</think><answer>4</answer> done", 0.0),  # text after
    ("<think>x</think> and <answer>4</answer>", 0.0),  # text between
    ("<think>x</think><answer>4</answer><answer>5</answer>", 0.0),  # two answers
    ("<think>a</think><think>b</think><answer>4</answer>", 0.0),  # two thinks
    ("<think>a <answer>3</answer></think><answer>4</answer>", 0.0),  # answer inside think
    ("<think>a</think><answer>4", 0.0),  # unclosed answer
])
def test_tags_format_reward(completion, reward):
    assert format_reward("prompt", completion, {}, answer_format="tags") == reward
    assert functools.partial(format_reward, answer_format="tags")("p", completion, {}) == reward
