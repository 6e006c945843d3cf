"""Multiplication with a calculator tool: the task that needs a tool (multi-turn RL).

A prompt multiplies two n-digit numbers ("4821*7306="); a tiny policy cannot compute the
product, but it has a calculator, called in the plain tag format of `jaxrl.envs`:

    4821*7306=<call>4821*7306</call><result>35222226</result>35222226<eos>
    |-prompt-||------ turn 1 -------||-- observation --||- turn 2 -|

The first turn ends at the "</call>" tag (one token of the task's tokenizer), the calculator
environment appends "<result>...</result>" (masked out of the loss), and the second turn is
the answer. Two host rewards, position by position with partial credit like the addition
task's:

    tool_call  the first turn against "<call>" + the prompt's expression + "</call>":
               (1/(E+2)) · (1[starts with <call>] + Σ_i 1[c_i = e_i] + 1[the call ends at E])
    answer     the text after the last "</result>" against the product's L digits,
               (1/(L+1)) · (Σ_i 1[a_i = t_i] + 1[len(a) = L]), and only once the completion
               holds the calculator's result "<result>PRODUCT</result>"; else 0

weighted 0.5 each, so the total is in [0, 1] and a sample is solved when both are 1. The
call reward is shaping: no random policy writes a whole call, so without it the answer
reward would never see a product. The answer's gate makes this a tool-use task: a tiny
policy cannot compute the product, and without the gate its guessed digits would earn
random partial credit, noise that drowns the call's small per-character signal
(benchmarks/README.md, "Multi-turn RL with a calculator tool").

Operands are drawn from [10^(n-1), 10^n) (no leading zeros: the calculator reads Python
integers); a fixed tenth of the pairs is held out for evaluation (`addition.held_out`).
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerFast

from jaxrl.data.tasks.addition import held_out
from jaxrl.data.tasks.task import Task, no_device_fields
from jaxrl.data.tokenizer import make_char_tokenizer
from jaxrl.rl.rewards import PythonReward

MULTIPLICATION_ALPHABET = "0123456789*="
CALL, CALL_END, RESULT, RESULT_END = "<call>", "</call>", "<result>", "</result>"
TAGS = (CALL, CALL_END, RESULT, RESULT_END)
ANSWER_WEIGHT, CALL_WEIGHT = 0.5, 0.5
_CHUNK = 1024


def make_tool_tokenizer() -> PreTrainedTokenizerFast:
    """Characters of MULTIPLICATION_ALPHABET plus the four tags as single tokens (20 ids)."""
    return make_char_tokenizer(MULTIPLICATION_ALPHABET, extra_tokens=TAGS)


def sample_problems(num_digits: int, n: int, seed: int, split: str = "train"
                    ) -> list[dict[str, str]]:
    """n rows {"prompt", "expression", "answer"} of `split` ("train": not held out, with
    repeats; "eval": held out), the same for the same seed."""
    if not 1 <= num_digits <= 9:
        raise ValueError(f"num_digits must be in [1, 9] for the tool task, got {num_digits}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    low, high = 10 ** (num_digits - 1), 10**num_digits
    rng = np.random.default_rng(seed)
    chunks, count = [], 0
    while count < n:
        chunk = rng.integers(low, high, size=(_CHUNK, 2), dtype=np.int64)
        keep = held_out(chunk[:, 0], chunk[:, 1]) == (split == "eval")
        chunks.append(chunk[keep])
        count += int(keep.sum())
    pairs = np.concatenate(chunks)[:n]
    return [{"prompt": f"{x}*{y}=", "expression": f"{x}*{y}", "answer": str(int(x) * int(y))}
            for x, y in pairs]


def _positional(text: str, target: str) -> int:
    return sum(a == b for a, b in zip(text, target, strict=False))


def answer_reward(prompt: str, completion: str, fields: dict[str, Any]) -> float:
    """The final answer against the product, per digit, plus ending right; 0 before the
    calculator returned the product (docstring)."""
    target = fields["answer"]
    if f"{RESULT}{target}{RESULT_END}" not in completion:
        return 0.0
    final = completion.rsplit(RESULT_END, 1)[-1]
    return (_positional(final, target) + (len(final) == len(target))) / (len(target) + 1)


def tool_call_reward(prompt: str, completion: str, fields: dict[str, Any]) -> float:
    """The first turn against the right call, per character (docstring)."""
    expression = fields["expression"]
    if not completion.startswith(CALL):
        return 0.0
    body = completion[len(CALL):].split(CALL_END, 1)
    closed = len(body) == 2 and len(body[0]) == len(expression)
    return (1 + _positional(body[0], expression) + closed) / (len(expression) + 2)


def tool_multiplication_task(num_digits: int, num_prompts: int, seed: int) -> Task:
    """The task, with the calculator tool environment ("tools") as its own."""
    def rewards(tokenizer):
        return [PythonReward("answer", answer_reward, weight=ANSWER_WEIGHT),
                PythonReward("tool_call", tool_call_reward, weight=CALL_WEIGHT)]

    def eval_rows(n: int, eval_seed: int) -> datasets.Dataset:
        return datasets.Dataset.from_list(sample_problems(num_digits, n, eval_seed, "eval"))

    rows = datasets.Dataset.from_list(sample_problems(num_digits, num_prompts, seed))
    return Task("tool_multiplication", rows, ("answer", "expression"), rewards,
                no_device_fields, tokenizer=make_tool_tokenizer, eval_rows=eval_rows, env="tools")
