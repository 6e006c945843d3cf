"""GSM8K-style math word problems: the answer is checked for mathematical equality.

A prompt is the question followed by PROMPT_SUFFIX, which asks for the final answer in
\\boxed{...}. The gold answer comes from the row's `answer` field: GSM8K writes a worked
solution ending in "#### 72", and the gold is the text after the last "####" with thousands
separators removed; a field without "####" is taken whole, so datasets whose answer column
is already the bare answer work too.

The final answer of a completion is the content of its last complete \\boxed{...} (braces
balanced, so \\boxed{\\frac{1}{2}} gives \\frac{1}{2}); without one, the rest of the line of its
last "####"; a box or line that is blank is no answer. Two host rewards (PythonReward fns):

    math_reward    1 if math_verify finds the final answer equal to the gold (0.5 = 1/2,
                   72.0 = 72, \\$72 = 72), else 0; 0 when there is no final answer.
    format_reward  1 if the completion has exactly one top-level non-blank \\boxed{...}.

Both strings are given to math_verify re-boxed, "\\boxed{<answer>}", so its LaTeX parser
reads them: the model was asked to write LaTeX, and a boxed gold parses the same way.

Timeouts: math_verify guards parse and verify with a signal.alarm timeout, which works only
in the main thread (elsewhere it raises ValueError). On the main thread (split mode, and the
host callbacks of the CPU backend) each call gets TIMEOUT_S seconds, and a pathological
answer such as 9^{9^{9^{9}}} that runs out of time scores 0; on any other thread the timeouts
are off (math_verify logs a warning once per process), so such an answer can stall the reward.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from math_verify import parse, verify

PROMPT_SUFFIX = ("\n\nReason step by step, then write the final answer alone inside "
                 "\\boxed{...}.")

TIMEOUT_S = 5  # per math_verify call, on the main thread
_BOX_OPEN = "\\boxed{"
# A comma between digits that is followed by exactly three digits: "1,234" but not "1,23".
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def render_question(question: str) -> str:
    """The prompt text of a question: the question, then PROMPT_SUFFIX."""
    return question.strip() + PROMPT_SUFFIX


def gold_answer(answer_field: str) -> str:
    """The gold answer in a GSM8K `answer` field: after the last "####", no thousands commas."""
    _, sep, tail = answer_field.rpartition("####")
    gold = _THOUSANDS_RE.sub("", (tail if sep else answer_field).strip())
    if not gold:
        raise ValueError(f"no answer in the answer field {answer_field!r}")
    return gold


def _boxed_contents(text: str) -> list[str]:
    """The non-blank contents of the top-level complete \\boxed{...} groups, in order."""
    contents = []
    start = text.find(_BOX_OPEN)
    while start != -1:
        body = start + len(_BOX_OPEN)
        depth, end = 1, body
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        if depth:  # unclosed (e.g. a truncated completion): look for a later box
            start = text.find(_BOX_OPEN, body)
            continue
        content = text[body:end - 1].strip()
        if content:
            contents.append(content)
        start = text.find(_BOX_OPEN, end)
    return contents


def final_answer(completion: str) -> str | None:
    """The last \\boxed{...} content, else the rest of the last "####" line, else None."""
    boxed = _boxed_contents(completion)
    if boxed:
        return boxed[-1]
    _, sep, tail = completion.rpartition("####")
    line = tail.split("\n", 1)[0].strip() if sep else ""
    return line or None


def math_reward(prompt: str, completion: str, fields: dict[str, Any]) -> float:
    """1.0 if the final answer equals the gold of fields["answer"] (math_verify), else 0.0."""
    if "answer" not in fields:
        raise KeyError(f"math_reward needs the task field 'answer' (the gold answer); the "
                       f"row has fields {sorted(fields)}")
    gold = gold_answer(str(fields["answer"]))
    answer = final_answer(completion)
    if answer is None:
        return 0.0
    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"{_BOX_OPEN}{gold}}}", parsing_timeout=timeout)
    answer_parsed = parse(f"{_BOX_OPEN}{answer}}}", parsing_timeout=timeout)
    return float(verify(gold_parsed, answer_parsed, timeout_seconds=timeout))


def format_reward(prompt: str, completion: str, fields: dict[str, Any]) -> float:
    """1.0 if the completion has exactly one non-blank \\boxed{...} answer, else 0.0."""
    return float(len(_boxed_contents(completion)) == 1)
