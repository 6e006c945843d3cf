"""What a tool is: a named host function from one string argument to a text result.

    tool = Calculator()
    result = tool({"expression": "2**10"})      ToolResult(text="1024", error=False, ...)

A tool never raises on bad input, a limit or a crash of what it runs: every failure is a
`ToolResult` with `error=True` and a short readable `text`, which the environment shows the
policy as the tool's answer (a policy learns from a wrong call; an exception would end the
rollout). Tools are immutable, so one instance serves every sample and worker thread.

Both built-in tools take one string argument (`tool.argument`). A lone argument is taken
whatever its name, so the tags format (which names no argument) and a model that misnames it
both reach the tool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """A tool's answer: its text, whether it failed, whether a time limit stopped it, and the
    seconds it took."""

    text: str
    error: bool = False
    timed_out: bool = False
    latency_s: float = 0.0


class Tool(Protocol):
    name: str
    description: str
    argument: str  # the name of its one string argument

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        """The call's arguments (parsed from the turn) -> its result; never raises."""
        ...


def string_argument(arguments: Mapping[str, Any], name: str) -> str | ToolResult:
    """`arguments[name]` (or the lone argument, whatever its name) if it is a string, else an
    error result that says what was expected."""
    if name in arguments:
        value = arguments[name]
    elif len(arguments) == 1:
        (value,) = arguments.values()
    else:
        return ToolResult(f"error: expected one string argument {name!r}, got "
                          f"{sorted(map(str, arguments)) or 'none'}", error=True)
    if not isinstance(value, str):
        return ToolResult(f"error: argument {name!r} must be a string, got "
                          f"{type(value).__name__}", error=True)
    return value


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style function schema of `tool`, for a chat template's `tools=` (so the
    system prompt describes the tool the way the model was trained to read)."""
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description,
                         "parameters": {"type": "object",
                                        "properties": {tool.argument: {"type": "string"}},
                                        "required": [tool.argument]}}}
