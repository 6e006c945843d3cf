"""Environments by name: `resolve_env(spec)` finds the builder of a multi-turn environment.

    tools              ToolEnv: calculator / python tools in the model's call format (tool_env.py)
    my_pkg.envs:build  your own: "module:attribute", imported

A builder is `build(config, tokenizer) -> EnvFactory` (config: the ToolsConfig of the run,
which your builder may ignore; EnvFactory: dataset row -> Environment, see base.py).
`make_env_factory(spec, config, tokenizer)` resolves and builds in one go. Every failure is a
ValueError naming the spec and what was expected, raised before any model loads: an unknown
name lists the registered ones; a module that does not import, a missing attribute or an
object that is not callable says which.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from jaxrl.envs.base import EnvFactory
from jaxrl.envs.tool_env import ToolsConfig, make_tool_env_factory

EnvBuilder = Callable[[ToolsConfig, Any], EnvFactory]

_REGISTRY: dict[str, EnvBuilder] = {}
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_IMPORT_PATH = re.compile(rf"(?P<module>{_DOTTED}):(?P<attr>{_DOTTED})")


def register_env(name: str, builder: EnvBuilder) -> None:
    """Registers `builder` under `name` (a name without ':'; registering a name twice is an
    error, so two environments never silently shadow each other)."""
    if not name or ":" in name:
        raise ValueError(f"environment name {name!r} must be non-empty and without ':' (':' "
                         "marks an import path)")
    if name in _REGISTRY and _REGISTRY[name] is not builder:
        raise ValueError(f"environment {name!r} is already registered")
    if not callable(builder):
        raise ValueError(f"environment {name!r}: the builder is a {type(builder).__name__}, not "
                         "callable")
    _REGISTRY[name] = builder


def registered_envs() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def resolve_env(spec: str) -> EnvBuilder:
    """The builder registered as `spec`, or the attribute at import path "module:attribute"."""
    if not isinstance(spec, str):
        raise ValueError(f"environment {spec!r} is a {type(spec).__name__}; expected a "
                         f"registered name {registered_envs()} or 'module:attribute'")
    spec = spec.strip()
    if ":" not in spec:
        if spec not in _REGISTRY:
            raise ValueError(f"unknown environment {spec!r}; registered: {registered_envs()} "
                             "(or give an import path 'module:attribute')")
        return _REGISTRY[spec]
    match = _IMPORT_PATH.fullmatch(spec)
    if match is None:
        raise ValueError(f"environment {spec!r} is not an import path 'module:attribute' such "
                         "as 'my_pkg.envs:build'")
    module_name, attr = match["module"], match["attr"]
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # any failure of the user's module to import (missing, syntax, deps)
        raise ValueError(f"environment {spec!r}: module {module_name!r} does not import: "
                         f"{type(e).__name__}: {e}") from e
    walked = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"environment {spec!r}: {walked!r} has no attribute {part!r}")
        obj = getattr(obj, part)
        walked = f"{walked}{':' if walked == module_name else '.'}{part}"
    if not callable(obj):
        raise ValueError(f"environment {spec!r} is a {type(obj).__name__}, not callable; "
                         "expected build(config, tokenizer) -> EnvFactory")
    return obj


def make_env_factory(spec: str, config: ToolsConfig, tokenizer: Any = None) -> EnvFactory:
    """resolve_env(spec)(config, tokenizer), checked to be a callable factory."""
    factory = resolve_env(spec)(config, tokenizer)
    if not callable(factory):
        raise ValueError(f"environment {spec!r}: its builder returned a "
                         f"{type(factory).__name__}, not a factory row -> Environment")
    return factory


register_env("tools", make_tool_env_factory)
