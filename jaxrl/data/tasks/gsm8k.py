"""GSM8K-style math word problems: the final answer is checked for mathematical equality.

A prompt is the question followed by the answer format's instruction (formats.py: \\boxed{}
by default, or <think>/<answer> tags). The gold answer comes from the row's `answer` field:
GSM8K writes a worked solution ending in "#### 72", and the gold is the text after the last
"####" with thousands separators removed; a field without "####" is taken whole, so datasets
whose answer column is already the bare answer work too.

`math_reward` is `formats.final_answer_reward` of this gold; the task's format reward is the
answer format's (formats.format_reward).
"""

from __future__ import annotations

from jaxrl.data.section import AnswerFormat
from jaxrl.data.tasks import answers, formats


def render_question(question: str, answer_format: AnswerFormat = "boxed") -> str:
    """The prompt text of a question: the question, then the answer format's instruction."""
    return formats.instruct(question, answer_format)


def gold_answer(answer_field: str) -> str:
    """The gold answer in a GSM8K `answer` field: after the last "####", no thousands commas."""
    _, sep, tail = answer_field.rpartition("####")
    gold = answers.drop_thousands_separators((tail if sep else answer_field).strip())
    if not gold:
        raise ValueError(f"no answer in the answer field {answer_field!r}")
    return gold


math_reward = formats.final_answer_reward(gold_answer)
