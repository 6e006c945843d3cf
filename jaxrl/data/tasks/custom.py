"""Custom tasks (`data.task: custom`): your prompts, your reward function.

Prompts are the `data.prompt_column` values verbatim (no instruction is added; the chat
template still applies when `data.chat_template` is on), the columns `data.fields` go to the
reward as host fields, and the reward is the function `data.reward_fn` names. The same key
replaces the correctness reward of gsm8k and math.

`load_reward_fn("my_pkg.rewards:score")` imports `my_pkg.rewards` and returns its attribute
`score` (a dotted attribute such as "Scorer.score" is followed), which must be callable as a
PythonReward fn: fn(prompt: str, completion: str, fields: dict) -> float in [0, 1]. The reward
is named after the attribute's last part (metric `reward/score`). It is resolved when the task
is made, before any model loads or anything compiles: a path that is not "module:attribute",
a module that does not import, a missing attribute, or an object that is not callable with
those three arguments is a ValueError naming the path and what failed.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

PythonRewardFn = Callable[[str, str, dict[str, Any]], float]
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"  # identifiers joined by dots
_PATH_RE = re.compile(rf"(?P<module>{_DOTTED}):(?P<attr>{_DOTTED})")


def render_custom_prompt(text: str) -> str:
    """A custom prompt is the column's text as it is."""
    return text


def load_reward_fn(path: str) -> tuple[str, PythonRewardFn]:
    """(name, fn) of the reward function at import path "module:attribute" (module docstring)."""
    match = _PATH_RE.fullmatch(path.strip()) if isinstance(path, str) else None
    if match is None:
        raise ValueError(f"data.reward_fn={path!r} is not an import path 'module:attribute' "
                         f"such as 'my_pkg.rewards:score'")
    module_name, attr = match["module"], match["attr"]
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # any failure of the user's module to import (syntax, missing deps)
        raise ValueError(f"data.reward_fn={path!r}: module {module_name!r} does not import: "
                         f"{type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            missing = f" ({part!r} is missing)" if part != attr else ""
            raise ValueError(f"data.reward_fn={path!r}: {module_name!r} has no attribute "
                             f"{attr!r}{missing}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"data.reward_fn={path!r} is a {type(obj).__name__}, not callable: "
                         f"expected fn(prompt, completion, fields) -> float")
    try:
        inspect.signature(obj).bind("", "", {})
    except TypeError as e:
        raise ValueError(f"data.reward_fn={path!r} cannot be called as fn(prompt, completion, "
                         f"fields) -> float: {e}") from None
    except ValueError:  # no signature to inspect (some builtins): trust the call
        pass
    return attr.rsplit(".", 1)[-1], obj
