"""Multi-turn environments: the protocol (base.py), tool-call formats, tools, ToolEnv, registry."""

from jaxrl.envs.base import (
    EnvFactory,
    EnvFailure,
    Environment,
    Observation,
    ToolStats,
    observation_problem,
)
from jaxrl.envs.calculator import Calculator
from jaxrl.envs.python_tool import PythonTool
from jaxrl.envs.registry import (
    EnvBuilder,
    make_env_factory,
    register_env,
    registered_envs,
    resolve_env,
)
from jaxrl.envs.tool_calls import (
    FormatName,
    HermesFormat,
    Llama3Format,
    TagsFormat,
    ToolCall,
    ToolCallError,
    ToolCallFormat,
    format_for,
    make_format,
)
from jaxrl.envs.tool_env import ToolEnv, build_tools, make_tool_env_factory
from jaxrl.envs.tools import Tool, ToolResult, tool_schema
from jaxrl.envs.tools_config import ToolName, ToolsConfig, ToolsFormat

__all__ = [
    "Calculator", "EnvBuilder", "EnvFactory", "EnvFailure", "Environment", "FormatName", "HermesFormat",
    "Llama3Format", "Observation", "PythonTool", "TagsFormat", "Tool", "ToolCall",
    "ToolCallError", "ToolCallFormat", "ToolEnv", "ToolName", "ToolResult", "ToolStats",
    "ToolsConfig", "ToolsFormat", "build_tools", "format_for", "make_env_factory", "make_format", "make_tool_env_factory",
    "observation_problem", "register_env", "registered_envs", "resolve_env", "tool_schema",
]
