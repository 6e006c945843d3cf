"""The `data` section: the task (prompts + verifier rewards) and how its prompts are batched;
the data package's own frozen type, which the experiment config holds (`jaxrl.config`).

    task               addition (synthetic) | tool_multiplication (synthetic, multi-turn: a
                       calculator tool) | gsm8k | math (MATH-style) | custom
    source             dataset tasks: a data file, a directory or a Hugging Face dataset name
                       (jaxrl.data.sources); addition makes its own prompts (null)
    subset, split      the dataset config ("main") and the split training reads ("train")
    eval_source        held-out rows for evaluation: null is the training source (and subset);
    eval_split         null is the training split name. Setting either gives the task eval_rows;
                       both null: a dataset task has none
    prompt_column      the question column (custom: the prompt, verbatim)
    answer_column      gsm8k / math: the gold answer column, carried to rewards as "answer"
    fields             more columns carried to the rewards as host fields, by their own names
    difficulty_column  a numeric column kept in the task's rows (curricula read it)
    format             boxed | tags: what gsm8k / math prompts ask for and where the final
                       answer is (jaxrl.data.tasks.formats)
    format_weight      weight of the format reward (0: off)
    reward_fn          "module:attribute" of a PythonReward fn: custom's reward; for gsm8k /
                       math it replaces the correctness reward (the format reward stays)
    reward_bounds      [low, high]: the values reward_fn may return; others count as errors
    num_digits, num_prompts   addition: operand digits, prompts drawn for training
    chat_template, max_prompt_len, batch_size   tokenizing and batching (prompts per step)
    curriculum         none | pass_rate | ordered: which prompts each step takes
    env                multi-turn: the environment each sample talks to between its turns,
                       a registered name (tools) or "module:attribute" of a factory
                       (row -> Environment, `jaxrl.envs`); null: the task's own (none for
                       single-turn tasks)
    env_timeout_s      the longest one env.step (one turn's answer) may take; a call past it
                       ends the run naming the environment, row and turn (120 s)
    tools              the tool environment's tools, call format and limits: a
                       `jaxrl.envs.ToolsConfig` (its docstring has the keys)

Everything that can be checked without reading data is checked here, when the config is made;
the rest (columns, rows, the reward function) when the task is made.

"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

from jaxrl.config_base import fail, require_at_least
from jaxrl.envs.tools_config import ToolsConfig

TaskName = Literal["addition", "tool_multiplication", "gsm8k", "math", "custom"]
AnswerFormat = Literal["boxed", "tags"]  # jaxrl.data.tasks.formats
ANSWER_FORMATS: tuple[AnswerFormat, ...] = get_args(AnswerFormat)
Curriculum = Literal["none", "pass_rate", "ordered"]
SYNTHETIC_TASKS = ("addition", "tool_multiplication")  # make their own prompts and tokenizer
MATH_TASKS = ("gsm8k", "math")  # an answer column, math-verify correctness, a format
# Keys that only dataset tasks read: a synthetic task rejects them when they are set.
_DATASET_KEYS = ("source", "subset", "split", "eval_source", "eval_split", "fields",
                 "difficulty_column", "format", "format_weight", "reward_fn", "reward_bounds")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """`data` (module docstring), checked on creation."""

    task: TaskName = "addition"
    source: str | None = None  # a data file, a directory, or a dataset name like openai/gsm8k
    subset: str | None = None  # the Hugging Face dataset config, e.g. "main" for openai/gsm8k
    split: str = "train"  # a data file holds the one split "train"
    eval_source: str | None = None  # held-out rows: null is `source` (with `subset`)
    eval_split: str | None = None  # null is `split`'s name
    prompt_column: str = "prompt"  # gsm8k / math: the question; custom: the prompt, verbatim
    answer_column: str = "answer"  # gsm8k / math: the gold answer (or a worked solution)
    fields: list[str] = dataclasses.field(default_factory=list)  # more columns for rewards
    difficulty_column: str | None = None  # numeric, kept in the task's rows for curricula
    format: AnswerFormat = "boxed"  # gsm8k / math: \boxed{} answer, or <think>/<answer> tags
    format_weight: float = 0.0  # weight of the format reward (0: off)
    reward_fn: str | None = None  # "module:attribute": custom's reward, else the correctness's
    # The range of reward_fn's values; one outside it is a reward error (jaxrl.rl.rewards).
    reward_bounds: list[float] = dataclasses.field(default_factory=lambda: [0.0, 1.0])
    num_digits: int = 2  # addition: operand digits
    num_prompts: int = 20_000  # synthetic tasks: prompts generated for training
    chat_template: bool = True  # render prompts with the tokenizer's template if it has one
    max_prompt_len: int = 256  # longer prompts are dropped (and counted), never truncated
    batch_size: int = 32  # prompts per step (x rollout.num_generations samples)
    curriculum: Curriculum = "none"  # which prompts a step takes: jaxrl.data.curriculum
    env: str | None = None  # multi-turn: "tools" or "module:attribute"; null: the task's own
    env_timeout_s: float = 120.0  # the longest one env.step may take (a hung one ends the run)
    tools: ToolsConfig = dataclasses.field(default_factory=ToolsConfig)

    def __post_init__(self):
        if self.task not in get_args(TaskName):
            raise ValueError(f"unknown task {self.task!r}; expected one of "
                             f"{', '.join(get_args(TaskName))}")
        require_at_least("data", self, ("num_prompts", "max_prompt_len", "batch_size"))
        if self.curriculum == "ordered" and self.difficulty_column is None:
            raise ValueError("data.curriculum=ordered goes from easy to hard: set "
                             "data.difficulty_column to a numeric column of the dataset")
        if not 1 <= self.num_digits <= 18:
            fail("data", self, "num_digits", "in [1, 18]")
        if self.task == "tool_multiplication" and self.num_digits > 9:
            fail("data", self, "num_digits", "in [1, 9] for data.task=tool_multiplication")
        if self.env is not None and not self.env.strip():
            fail("data", self, "env", "a registered environment name or \"module:attribute\", "
                                      "or null")
        if not (0 < self.env_timeout_s < math.inf):
            fail("data", self, "env_timeout_s", "a finite number of seconds > 0")
        if not isinstance(self.tools, ToolsConfig):
            fail("data", self, "tools", "a ToolsConfig")
        if self.format not in ANSWER_FORMATS:
            fail("data", self, "format", f"one of {', '.join(ANSWER_FORMATS)}")
        if not (math.isfinite(self.format_weight) and self.format_weight >= 0):
            fail("data", self, "format_weight", "a finite number >= 0 (0: off)")
        bounds = list(self.reward_bounds)
        if not (len(bounds) == 2 and all(math.isfinite(x) for x in bounds)
                and bounds[0] < bounds[1]):
            fail("data", self, "reward_bounds", "two finite numbers [low, high] with low < high")
        if self.task in SYNTHETIC_TASKS:
            self._check_synthetic()
        else:
            self._check_dataset()

    def _check_synthetic(self) -> None:
        for field in dataclasses.fields(DataSection):
            if field.name not in _DATASET_KEYS:
                continue
            default = (field.default if field.default_factory is dataclasses.MISSING
                       else field.default_factory())
            if getattr(self, field.name) != default:
                others = ", ".join(t for t in get_args(TaskName) if t not in SYNTHETIC_TASKS)
                shown = "null" if default is None else repr(default)
                raise ValueError(f"data.{field.name} must be {shown} for data.task="
                                 f"{self.task} (it makes its own prompts), got "
                                 f"{getattr(self, field.name)!r}; for a dataset, set data.task "
                                 f"to one of {others}")

    def _check_dataset(self) -> None:
        if not self.source:
            raise ValueError(f"data.source must name the prompts of data.task={self.task}: a data "
                             f"file, a directory or a Hugging Face dataset name, got "
                             f"{self.source!r}")
        if self.task == "custom" and not self.reward_fn:
            raise ValueError("data.task=custom scores completions with your function: set "
                             "data.reward_fn to its import path, 'my_pkg.rewards:score'")
        for key in ("split", "prompt_column", "answer_column"):
            if not getattr(self, key):
                raise ValueError(f"data.{key} must be a non-empty name, got {getattr(self, key)!r}")
        if len(set(self.fields)) != len(self.fields):
            raise ValueError(f"data.fields must name distinct columns, got {list(self.fields)}")
        if "prompt" in self.fields:
            raise ValueError(f"data.fields must not hold 'prompt': rewards get the prompt text "
                             f"already, got {list(self.fields)}")
        if self.task in MATH_TASKS and "answer" in self.fields:
            raise ValueError(f"data.fields must not hold 'answer' for data.task={self.task}: it "
                             f"carries data.answer_column={self.answer_column!r} as the field "
                             f"'answer', got {list(self.fields)}")
        if self.held_out() == (self.source, self.subset, self.split):
            raise ValueError(f"data.eval_source / data.eval_split name the training rows "
                             f"({self.source!r} split {self.split!r}): held-out rows must be "
                             f"another split or source")

    def held_out(self) -> tuple[str, str | None, str] | None:
        """(source, subset, split) of the held-out rows; None when neither eval key is set.

        A different `eval_source` has no subset (`subset` belongs to the training source).
        """
        if self.eval_source is None and self.eval_split is None:
            return None
        if self.eval_source in (None, self.source):
            return self.source, self.subset, self.eval_split or self.split
        return self.eval_source, None, self.eval_split or self.split
