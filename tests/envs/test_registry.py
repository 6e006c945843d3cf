"""Environments by name or import path, and the errors that name what is wrong."""

import pytest

from jaxrl.envs.base import Observation
from jaxrl.envs.registry import make_env_factory, register_env, registered_envs, resolve_env
from jaxrl.envs.tool_env import make_tool_env_factory
from jaxrl.envs.tools_config import ToolsConfig

NOT_CALLABLE = 3


class Done:
    def step(self, turn):
        return Observation(done=True, reward=1.0)


def build_done(config, tokenizer):
    return lambda row: Done()


def build_nothing(config, tokenizer):
    return None


class Builders:
    build = staticmethod(build_done)


def test_tools_is_registered():
    assert "tools" in registered_envs()
    assert resolve_env("tools") is make_tool_env_factory
    env = make_env_factory("tools", ToolsConfig(), None)({"prompt": "p"})
    assert env.step("<call>1+2</call>").text == "<result>3</result>"


def test_user_import_path():
    assert resolve_env("tests.envs.test_registry:build_done") is build_done
    assert resolve_env(" tests.envs.test_registry:Builders.build ") is build_done
    factory = make_env_factory("tests.envs.test_registry:build_done", ToolsConfig())
    assert factory({}).step("anything") == Observation(done=True, reward=1.0)


@pytest.mark.parametrize("spec, message", [
    ("tool", r"unknown environment 'tool'; registered: \[.*'tools'.*\]"),
    ("a:b:c", "'a:b:c' is not an import path 'module:attribute'"),
    ("no_such_module_xyz:build", "module 'no_such_module_xyz' does not import: "
                                 "ModuleNotFoundError"),
    ("tests.envs.test_registry:nope", "'tests.envs.test_registry' has no attribute 'nope'"),
    ("tests.envs.test_registry:Builders.nope",
     "'tests.envs.test_registry:Builders' has no attribute 'nope'"),
    ("tests.envs.test_registry:NOT_CALLABLE", "is a int, not callable; expected "
                                              r"build\(config, tokenizer\) -> EnvFactory"),
])
def test_resolution_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_env(spec)


def test_builder_must_return_a_factory():
    register_env("test-broken", build_nothing)
    with pytest.raises(ValueError, match="'test-broken': its builder returned a NoneType"):
        make_env_factory("test-broken", ToolsConfig())


def test_register_errors():
    with pytest.raises(ValueError, match="already registered"):
        register_env("tools", build_done)
    with pytest.raises(ValueError, match="without ':'"):
        register_env("a:b", build_done)
    with pytest.raises(ValueError, match="not callable"):
        register_env("test-not-callable", 3)
    register_env("tools", make_tool_env_factory)  # the same builder again is fine
