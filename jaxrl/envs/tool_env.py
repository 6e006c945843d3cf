"""ToolEnv: the environment of tool-using episodes (call a tool, read the result, answer).

    turn ends on an end tag, has calls   run them (at most max_calls_per_turn) ->
                                         Observation(text=format.render_results(results),
                                                     tools=ToolStats(calls, errors, timeouts, s))
    turn without a call                  Observation(done=True): the final answer; its reward
                                         comes from the task's reward functions

Calls run one after another, in the order written. Each call gives one result, so the policy
sees an answer for every call it wrote: a malformed call (format.parse's ToolCallError), an
unknown tool, and a call beyond max_calls_per_turn answer with an error result (counted in
`errors`, never run). The environment holds no state between turns, so the tools (immutable)
are shared by every sample.

    ToolsConfig(names=["python"], format="auto", ...)  ->  make_tool_env_factory(config,
    tokenizer)  ->  factory(row) -> ToolEnv

`format="auto"` picks the format from the tokenizer's chat template (tool_calls.format_for).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.envs.base import EnvFactory, Observation, ToolStats
from jaxrl.envs.calculator import Calculator
from jaxrl.envs.python_tool import PythonTool
from jaxrl.envs.tool_calls import (
    TagsFormat,
    ToolCall,
    ToolCallError,
    ToolCallFormat,
    format_for,
    make_format,
)
from jaxrl.envs.tools import Tool, ToolResult
from jaxrl.envs.tools_config import ToolsConfig


def build_tools(config: ToolsConfig) -> tuple[Tool, ...]:
    """The configured tools, in order."""
    builders = {
        "calculator": Calculator,
        "python": lambda: PythonTool(timeout_s=config.python_timeout_s,
                                     memory_mb=config.python_memory_mb,
                                     max_output_bytes=config.python_max_output_bytes,
                                     sandbox=config.python_sandbox),
    }
    return tuple(builders[name]() for name in config.names)


@dataclasses.dataclass(frozen=True)
class ToolEnv:
    """Runs the tool calls of a turn; a turn without calls ends the episode (module docstring)."""

    tools: Sequence[Tool]
    format: ToolCallFormat
    max_calls_per_turn: int = 4
    # Each result's text is cut to this many characters (None: whole): an error message is
    # long for a small model's budget, and its gist is in its first words.
    max_result_chars: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "tools", tuple(self.tools))
        if not self.tools:
            raise ValueError("ToolEnv needs at least one tool")
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"ToolEnv: two tools have the same name: {names}")
        if self.max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {self.max_calls_per_turn}")

    @property
    def tools_by_name(self) -> Mapping[str, Tool]:
        return {tool.name: tool for tool in self.tools}

    def step(self, turn: str) -> Observation:
        calls = self.format.parse(turn)
        if not calls:
            return Observation(done=True)
        results = [self._run(call) if i < self.max_calls_per_turn else
                   ToolResult(f"error: more than {self.max_calls_per_turn} tool calls in one "
                              "turn; this one was not run", error=True)
                   for i, call in enumerate(calls)]
        if self.max_result_chars is not None:
            results = [dataclasses.replace(r, text=r.text[:self.max_result_chars])
                       for r in results]
        stats = ToolStats(calls=len(results), errors=sum(r.error for r in results),
                          timeouts=sum(r.timed_out for r in results),
                          latency_s=sum(r.latency_s for r in results))
        return Observation(text=self.format.render_results(results), tools=stats)

    def _run(self, call: ToolCall | ToolCallError) -> ToolResult:
        if isinstance(call, ToolCallError):
            return ToolResult(f"error: {call.message}", error=True)
        by_name = self.tools_by_name
        if call.name is None:
            if len(self.tools) > 1:
                return ToolResult(f"error: name the tool first, one of {sorted(by_name)}",
                                  error=True)
            tool = self.tools[0]
        elif call.name in by_name:
            tool = by_name[call.name]
        else:
            return ToolResult(f"error: unknown tool {call.name!r}; the tools are "
                              f"{sorted(by_name)}", error=True)
        try:
            return tool(call.arguments)
        except Exception as e:  # a user's tool that raises: the policy sees an error, the run goes on
            return ToolResult(f"error: the tool {tool.name!r} failed: {type(e).__name__}: {e}",
                              error=True)


def make_tool_env_factory(config: ToolsConfig, tokenizer: Any = None) -> EnvFactory:
    """A factory of ToolEnvs with `config`'s tools and format (auto: from `tokenizer`'s chat
    template; the tags format learns the tool names)."""
    tools = build_tools(config)
    fmt = format_for(tokenizer) if config.format == "auto" else make_format(config.format)
    if isinstance(fmt, TagsFormat):
        fmt = dataclasses.replace(fmt, tool_names=tuple(tool.name for tool in tools))

    def factory(row: Mapping[str, Any]) -> ToolEnv:
        return ToolEnv(tools, fmt, config.max_calls_per_turn, config.max_result_chars)

    return factory
