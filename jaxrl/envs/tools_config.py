"""`ToolsConfig`: the tools a tool environment offers, their call format and limits. It is the
`data.tools` config section itself (`jaxrl.data.section` holds it): one type, one set of
checks, for the YAML key and for Python alike.

    names              which tools: calculator (integer/float arithmetic, in process) and
                       python (code run in a separate, limited process)
    format             how the policy calls them: auto (from the chat template: Qwen's
                       hermes <tool_call> JSON, Llama 3's JSON with <|eom_id|>, else tags),
                       hermes | llama3 | tags (<call>...</call>, <result>...</result>)
    max_calls_per_turn tool calls of one turn that run (the rest get an error observation)
    max_result_chars   each result's text cut to this many characters (null: whole); a small
                       model's token budget cannot hold a long error message
    python_timeout_s, python_memory_mb, python_max_output_bytes   the python tool's limits
    python_sandbox     bwrap: each call in a bubblewrap OS sandbox (jaxrl/envs/sandbox.py;
                       without `bwrap` the run refuses to start, saying how to install it) |
                       guard: the in-process audit hook alone, which is no security
                       boundary (a warning says so)

Used when the environment is `tools` (`data.env: tools`, or a task's own tool environment):
`jaxrl.envs.tool_env.make_tool_env_factory(config, tokenizer)`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

from jaxrl.config_base import fail

ToolName = Literal["calculator", "python"]
ToolsFormat = Literal["auto", "hermes", "llama3", "tags"]  # auto: tool_calls.format_for
SandboxKind = Literal["bwrap", "guard"]


@dataclasses.dataclass(frozen=True)
class ToolsConfig:
    """`data.tools` (module docstring), checked on creation."""

    names: list[str] = dataclasses.field(default_factory=lambda: ["calculator"])
    format: ToolsFormat = "auto"
    max_calls_per_turn: int = 4
    python_timeout_s: float = 5.0
    python_memory_mb: int = 1024
    python_max_output_bytes: int = 4096
    max_result_chars: int | None = None
    python_sandbox: SandboxKind = "bwrap"

    def __post_init__(self):
        known = get_args(ToolName)
        names = list(self.names)
        if not names or any(n not in known for n in names) or len(set(names)) != len(names):
            fail("data.tools", self, "names", f"a non-empty list of distinct tools from "
                                              f"{list(known)}")
        if self.format not in get_args(ToolsFormat):
            fail("data.tools", self, "format", f"one of {get_args(ToolsFormat)}")
        if self.python_sandbox not in get_args(SandboxKind):
            fail("data.tools", self, "python_sandbox", f"one of {get_args(SandboxKind)}")
        for name in ("max_calls_per_turn", "python_memory_mb", "python_max_output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail("data.tools", self, name, "an integer >= 1")
        if self.max_result_chars is not None and (isinstance(self.max_result_chars, bool)
                                                  or self.max_result_chars < 1):
            fail("data.tools", self, "max_result_chars", "an integer >= 1, or null")
        if not (0 < self.python_timeout_s < math.inf):
            fail("data.tools", self, "python_timeout_s", "a finite number of seconds > 0")
