"""MATH-style competition problems (`data.task: math`): the final answer is checked for
mathematical equality.

(The module is not called `math`, which would read as the standard library's.)

A prompt is the problem followed by the answer format's instruction (formats.py). The gold
answer comes from the row's `answer` field, which is the dataset's `data.answer_column`: the
content of its last complete \\boxed{...} when it has one (a worked `solution` as in
hendrycks MATH, "... so the answer is \\boxed{\\frac{1}{2}}."), else, when it has no
\\boxed{ at all, the field taken whole (a bare `answer` column as in MATH-500, "\\frac{1}{2}").
A field with neither is an error when the task is made (dataset.py checks every row).

`math_reward` is `formats.final_answer_reward` of this gold; the task's format reward is the
answer format's (formats.format_reward).
"""

from __future__ import annotations

from jaxrl.data.section import AnswerFormat
from jaxrl.data.tasks import answers, formats


def render_problem(problem: str, answer_format: AnswerFormat = "boxed") -> str:
    """The prompt text of a problem: the problem, then the answer format's instruction."""
    return formats.instruct(problem, answer_format)


def gold_answer(answer_field: str) -> str:
    """The gold answer in an answer or solution field: its last \\boxed{} content, else all."""
    boxed = answers.boxed_contents(answer_field)
    if boxed:
        gold = boxed[-1]
    else:  # a field with a box but no complete non-blank one has no answer
        gold = "" if answers.BOX_OPEN in answer_field else answer_field.strip()
    if not gold:
        raise ValueError(f"no answer in the answer field {answer_field!r}")
    return gold


math_reward = formats.final_answer_reward(gold_answer)
