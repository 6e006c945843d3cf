"""Answer formats (`data.format`): what the prompt asks for, where the final answer is, and
the format reward that checks the shape of a completion.

    boxed  the prompt asks to reason, then write the final answer alone in \\boxed{...}.
           Final answer: the last complete \\boxed{} (else the rest of the last "####" line,
           answers.boxed_answer). Format reward: 1 iff the completion has exactly one
           top-level non-blank \\boxed{...}.
    tags   the prompt asks to think inside <think> </think>, then write the final answer
           inside <answer> </answer>. Final answer: the content of the last complete
           <answer>...</answer> block, where a \\boxed{} inside it wins (its last one); a blank
           block, or none, is no answer. Format reward: 1 iff the completion is exactly one
           <think>...</think> block followed by exactly one non-blank <answer>...</answer>
           block, with nothing but whitespace around and between them (the think block may be
           empty; neither block may hold another think or answer tag).

Deviation to know: chat templates that open the think block themselves (the generation prompt
ends in "<think>", e.g. DeepSeek-R1's) produce completions without the opening tag, which the
tags format reward scores 0.

Format rewards are PythonReward fns; `answer_format` is keyword-only with the default boxed,
so a reward for the tags format is `functools.partial(format_reward, answer_format="tags")`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from jaxrl.data.section import ANSWER_FORMATS, AnswerFormat
from jaxrl.data.tasks import answers

PROMPT_SUFFIXES: dict[AnswerFormat, str] = {
    "boxed": "\n\nReason step by step, then write the final answer alone inside \\boxed{...}.",
    "tags": ("\n\nThink step by step inside <think> </think>, then write the final answer "
             "alone inside <answer> </answer>."),
}

_TAG_RE = re.compile(r"</?(?:think|answer)>")
_TAGS_SHAPE_RE = re.compile(
    r"\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
_ANSWER_BLOCK_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _check(answer_format: str) -> None:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer format must be one of {ANSWER_FORMATS}, got {answer_format!r}")


def instruct(question: str, answer_format: AnswerFormat) -> str:
    """The prompt of a question: the question, stripped, then the format's instruction."""
    _check(answer_format)
    return question.strip() + PROMPT_SUFFIXES[answer_format]


def final_answer(completion: str, answer_format: AnswerFormat) -> str | None:
    """The completion's final answer in `answer_format` (module docstring), or None."""
    _check(answer_format)
    if answer_format == "boxed":
        return answers.boxed_answer(completion)
    blocks = _ANSWER_BLOCK_RE.findall(completion)
    if not blocks:
        return None
    boxed = answers.boxed_contents(blocks[-1])
    return boxed[-1] if boxed else blocks[-1].strip() or None


def format_reward(prompt: str, completion: str, fields: dict[str, Any], *,
                  answer_format: AnswerFormat = "boxed") -> float:
    """1.0 if the completion has the shape `answer_format` asks for, else 0.0."""
    _check(answer_format)
    if answer_format == "boxed":
        return float(len(answers.boxed_contents(completion)) == 1)
    shape = _TAGS_SHAPE_RE.fullmatch(completion)
    return float(shape is not None and bool(shape["answer"].strip())
                 and not _TAG_RE.search(shape["think"]) and not _TAG_RE.search(shape["answer"]))


def final_answer_reward(gold_answer: Callable[[str], str]) -> Callable[..., float]:
    """The correctness reward of a math task whose gold is `gold_answer(fields["answer"])`:
    1.0 if math_verify finds the completion's final answer (`final_answer` of the answer
    format) equal to the gold (answers.equal), else 0.0; 0.0 without a final answer."""

    def math_reward(prompt: str, completion: str, fields: dict[str, Any], *,
                    answer_format: AnswerFormat = "boxed") -> float:
        return answers.equal(gold_answer(answers.answer_field(fields)),
                             final_answer(completion, answer_format))

    return math_reward
