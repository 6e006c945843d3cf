"""Math answers: pulling the final answer out of text, and checking it with math-verify.

Extraction, shared by the math tasks (gsm8k, competition_math) and the answer formats:

    boxed_contents(text)  the non-blank contents of the top-level complete \\boxed{...} groups,
                          braces balanced (\\boxed{\\frac{1}{2}} gives \\frac{1}{2}); an unclosed
                          box (a truncated completion) is none
    after_hashes(text)    the rest of the line of the last "####" (GSM8K's answer marker)
    boxed_answer(text)    the last boxed content, else after_hashes, else None

Checking: `equal(gold, answer)` is 1.0 when math_verify finds the two mathematically equal
(0.5 = 1/2, 72.0 = 72, \\$72 = 72), else 0.0. Both strings go to math_verify re-boxed,
"\\boxed{<answer>}", so its LaTeX parser reads them: the model was asked to write LaTeX, and a
boxed gold parses the same way.

Timeouts: math_verify guards parse and verify with a signal.alarm timeout, which works only in
the main thread (elsewhere it raises ValueError). On the main thread (split mode, and the host
callbacks of the CPU backend) each call gets TIMEOUT_S seconds, and a pathological answer such
as 9^{9^{9^{9}}} that runs out of time scores 0; on any other thread the timeouts are off
(math_verify logs a warning once per process), so such an answer can stall the reward.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

TIMEOUT_S = 5  # per math_verify call, on the main thread
BOX_OPEN = "\\boxed{"
# A comma between digits that is followed by exactly three digits: "1,234" but not "1,23".
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def boxed_contents(text: str) -> list[str]:
    """The non-blank contents of the top-level complete \\boxed{...} groups, in order."""
    contents = []
    start = text.find(BOX_OPEN)
    while start != -1:
        body = start + len(BOX_OPEN)
        depth, end = 1, body
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        if depth:  # unclosed (e.g. a truncated completion): look for a later box
            start = text.find(BOX_OPEN, body)
            continue
        content = text[body:end - 1].strip()
        if content:
            contents.append(content)
        start = text.find(BOX_OPEN, end)
    return contents


def after_hashes(text: str) -> str | None:
    """The rest of the line of the last "####", stripped; None without one or when blank."""
    _, sep, tail = text.rpartition("####")
    line = tail.split("\n", 1)[0].strip() if sep else ""
    return line or None


def boxed_answer(text: str) -> str | None:
    """The last \\boxed{...} content, else the rest of the last "####" line, else None."""
    boxed = boxed_contents(text)
    return boxed[-1] if boxed else after_hashes(text)


def drop_thousands_separators(text: str) -> str:
    """"1,234,567" -> "1234567"; commas not between digit groups of three stay."""
    return _THOUSANDS_RE.sub("", text)


def answer_field(fields: Mapping[str, Any]) -> str:
    """The row's task field "answer" (where the gold answer is), as text."""
    if "answer" not in fields:
        raise KeyError(f"a math reward needs the task field 'answer' (the gold answer); the "
                       f"row has fields {sorted(fields)}")
    return str(fields["answer"])


def equal(gold: str, answer: str | None) -> float:
    """1.0 if math_verify finds `answer` equal to `gold`, else 0.0 (0.0 for no answer)."""
    if answer is None:
        return 0.0
    # Imported at the first check: math_verify imports sympy (a second of start-up that most
    # commands, which never check a math answer, need not pay).
    from math_verify import parse, verify

    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"{BOX_OPEN}{gold}}}", parsing_timeout=timeout)
    answer_parsed = parse(f"{BOX_OPEN}{answer}}}", parsing_timeout=timeout)
    return float(verify(gold_parsed, answer_parsed, timeout_seconds=timeout))
