"""Tasks by name: `make_task(config, seed=...)` makes the `Task` that `data.task` names.

    addition  synthetic sums, an in-graph per-digit reward, its own tokenizer (addition.py)
    gsm8k     math word problems, gold after "####", math-verify correctness (gsm8k.py)
    math      MATH-style problems, gold the last \\boxed{} of the answer column or the column
              whole, math-verify correctness (competition_math.py)
    custom    prompts verbatim, your reward function `data.reward_fn` (custom.py)
    tool_multiplication   products of two numbers with a calculator tool (multi-turn), host
              rewards for the answer and the call (tool_multiplication.py)

The dataset tasks (all but addition) read and check their rows with dataset.py. Their rewards
all run on the host:

    correctness  gsm8k / math: "math", the task's math_reward in the answer format
                 `data.format`; with `data.reward_fn` set (custom always), that function
                 instead, named after it
    format       the answer format's format reward (formats.py), weight `data.format_weight`;
                 none when it is 0

`make_task` resolves `data.reward_fn` first and then reads the rows, so every failure (a reward
function that does not resolve; a source, split or column that is not there; an empty split; a
missing or non-numeric difficulty) is a ValueError or FileNotFoundError raised before any model
loads or anything compiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import datasets

from jaxrl.data.section import AnswerFormat, DataSection
from jaxrl.data.tasks import competition_math, custom, formats, gsm8k
from jaxrl.data.tasks.addition import AdditionTask, addition_reward, make_addition_tokenizer
from jaxrl.data.tasks.dataset import dataset_task
from jaxrl.data.tasks.task import Task
from jaxrl.data.tasks.tool_multiplication import tool_multiplication_task
from jaxrl.rl.rewards import JaxReward, PythonReward

__all__ = ["Task", "addition_task", "make_task"]

# The math tasks: the module with gold_answer and math_reward, and the prompt renderer.
_MATH_TASKS: dict[str, tuple[ModuleType, Callable[..., str]]] = {
    "gsm8k": (gsm8k, gsm8k.render_question),
    "math": (competition_math, competition_math.render_problem),
}


def make_task(config: DataSection, *, seed: int) -> Task:
    """The task `config.task` with its options (module docstring); `seed` draws synthetic rows."""
    if config.task == "addition":
        return addition_task(config.num_digits, config.num_prompts, seed)
    if config.task == "tool_multiplication":
        return tool_multiplication_task(config.num_digits, config.num_prompts, seed)
    rewards = _dataset_rewards(config)
    if config.task == "custom":
        return dataset_task(config, render=custom.render_custom_prompt, carry_answer=False,
                            gold=None, rewards=rewards)
    module, render = _MATH_TASKS[config.task]
    return dataset_task(config, render=_in_format(render, config.format), carry_answer=True,
                        gold=None if config.reward_fn else module.gold_answer, rewards=rewards)


def _dataset_rewards(config: DataSection) -> list[PythonReward]:
    """The correctness reward (or data.reward_fn's), then the format reward when weighted."""
    if config.reward_fn:
        name, fn = custom.load_reward_fn(config.reward_fn)
        try:
            correctness = PythonReward(name, fn, bounds=tuple(config.reward_bounds))
        except ValueError as e:
            raise ValueError(f"data.reward_fn={config.reward_fn!r}: {e}") from None
    else:
        correctness = PythonReward("math", _in_format(_MATH_TASKS[config.task][0].math_reward,
                                                      config.format))
    if not config.format_weight:
        return [correctness]
    if correctness.name == "format":
        raise ValueError(f"data.reward_fn={config.reward_fn!r} is named 'format' like the format "
                         f"reward (data.format_weight={config.format_weight}); rename it")
    return [correctness, PythonReward("format", _in_format(formats.format_reward, config.format),
                                      weight=config.format_weight)]


def _in_format(fn: Callable[..., Any], answer_format: AnswerFormat) -> Callable[..., Any]:
    """`fn` with its keyword `answer_format` bound; boxed, every fn's default, leaves fn as is."""
    if answer_format == "boxed":
        return fn
    return functools.partial(fn, answer_format=answer_format)


def addition_task(num_digits: int, num_prompts: int, seed: int) -> Task:
    """Two `num_digits`-digit numbers to add; an in-graph per-digit reward (addition.py)."""
    task = AdditionTask(num_digits)

    def rewards(tokenizer):
        def reward(inputs):
            return addition_reward(inputs.completion_ids_BxC, inputs.completion_mask_BxC,
                                   inputs.fields["target_ids"])
        return [JaxReward("addition", reward)]

    def device_fields(tokenizer, fields):
        return {"target_ids": task.answer_token_ids(tokenizer, list(fields["answer"]))}

    def eval_rows(n: int, eval_seed: int) -> datasets.Dataset:
        # Held-out problems: never among the training rows (addition.py).
        return datasets.Dataset.from_list(task.sample_problems(n, eval_seed, split="eval"))

    return Task("addition",
                datasets.Dataset.from_list(task.sample_problems(num_prompts, seed, split="train")),
                ("answer",), rewards, device_fields, tokenizer=make_addition_tokenizer,
                eval_rows=eval_rows)
