"""ToolEnv: a turn with calls runs them and answers with their results; one without ends."""

import dataclasses
import json

import pytest

from jaxrl.envs.base import Observation, ToolStats
from jaxrl.envs.calculator import Calculator
from jaxrl.envs.python_tool import PythonTool
from jaxrl.envs.tool_calls import HermesFormat, Llama3Format, TagsFormat
from jaxrl.envs.tool_env import ToolEnv, make_tool_env_factory
from jaxrl.envs.tools import ToolResult, string_argument, tool_schema
from jaxrl.envs.tools_config import ToolsConfig


@dataclasses.dataclass(frozen=True)
class Echo:
    """A fake tool: answers its argument, takes `latency_s`, fails or times out on request."""

    name: str = "echo"
    description: str = "echoes"
    argument: str = "text"
    latency_s: float = 0.25

    def __call__(self, arguments):
        text = string_argument(arguments, self.argument)
        if text == "raise":
            raise RuntimeError("boom")
        return ToolResult(text, error=text in ("fail", "slow"), timed_out=text == "slow",
                          latency_s=self.latency_s)


def hermes_call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_a_turn_with_calls_answers_with_results_and_stats():
    env = ToolEnv([Echo(), Calculator()], HermesFormat())
    obs = env.step("Checking." + hermes_call("calculator", expression="6*7")
                   + hermes_call("echo", text="fail") + hermes_call("echo", text="slow"))
    assert obs == Observation(
        text="<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n"
             "<tool_response>\nfail\n</tool_response>\n<tool_response>\nslow\n</tool_response>"
             "<|im_end|>\n<|im_start|>assistant\n",
        tools=ToolStats(calls=3, errors=2, timeouts=1, latency_s=obs.tools.latency_s))
    assert 0.5 <= obs.tools.latency_s < 0.51  # two echoes of 0.25 s and a calculator's µs


def test_a_turn_without_calls_ends_the_episode():
    env = ToolEnv([Calculator()], HermesFormat())
    assert env.step("The answer is 42.<|im_end|>") == Observation(done=True)
    llama = ToolEnv([Calculator()], Llama3Format())
    assert llama.step("The answer is 42.<|eot_id|>") == Observation(done=True)


def test_bad_calls_answer_with_errors_and_are_not_run():
    env = ToolEnv([Echo()], HermesFormat(), max_calls_per_turn=2)
    obs = env.step(hermes_call("nope", text="x") + "<tool_call>{bad}</tool_call>"
                   + hermes_call("echo", text="never run"))
    responses = obs.text.split("<tool_response>\n")[1:]
    assert [r.split("\n</tool_response>")[0] for r in responses] == [
        "error: unknown tool 'nope'; the tools are ['echo']",
        "error: the tool call is not valid JSON (Expecting property name enclosed in double "
        "quotes at character 1); expected {\"name\": ..., \"arguments\": {...}}",
        "error: more than 2 tool calls in one turn; this one was not run",
    ]
    assert obs.tools == ToolStats(calls=3, errors=3, timeouts=0, latency_s=0.0)
    assert not obs.done


def test_a_raising_tool_is_an_error_result():
    obs = ToolEnv([Echo()], TagsFormat()).step("<call>raise</call>")
    assert obs.text == "<result>error: the tool 'echo' failed: RuntimeError: boom</result>"
    assert obs.tools.errors == 1


def test_tool_env_errors():
    with pytest.raises(ValueError, match="at least one tool"):
        ToolEnv([], TagsFormat())
    with pytest.raises(ValueError, match=r"same name: \['echo', 'echo'\]"):
        ToolEnv([Echo(), Echo()], TagsFormat())
    with pytest.raises(ValueError, match="max_calls_per_turn must be >= 1"):
        ToolEnv([Echo()], TagsFormat(), max_calls_per_turn=0)


def test_tags_unnamed_call_needs_a_single_tool():
    assert ToolEnv([Calculator()], TagsFormat()).step("<call>2+3</call>").text == \
        "<result>5</result>"
    two = ToolEnv([Calculator(), Echo()], TagsFormat(tool_names=("calculator", "echo")))
    assert two.step("<call>2+3</call>").text == \
        "<result>error: name the tool first, one of ['calculator', 'echo']</result>"
    assert two.step("<call>calculator 2+3</call><call>echo hi</call>").text == \
        "<result>5</result><result>hi</result>"


def test_factory_from_config_with_python_and_auto_format():
    config = ToolsConfig(names=["calculator", "python"], python_timeout_s=2.0)
    factory = make_tool_env_factory(config, tokenizer=None)  # no chat template: tags
    env = factory({"prompt": "unused"})
    assert isinstance(env.format, TagsFormat)
    assert env.format.tool_names == ("calculator", "python")
    assert isinstance(env.tools[1], PythonTool) and env.tools[1].timeout_s == 2.0
    obs = env.step("<call>python print(6 * 7)</call>")
    assert obs.text == "<result>42\n</result>"
    assert obs.tools.calls == 1 and obs.tools.errors == 0 and obs.tools.latency_s > 0
    assert factory({}) is not env

    class QwenTokenizer:
        chat_template = "... <tool_call> ..."

    assert isinstance(make_tool_env_factory(ToolsConfig(), QwenTokenizer())({}).format,
                      HermesFormat)
    assert isinstance(make_tool_env_factory(ToolsConfig(format="llama3"), None)({}).format,
                      Llama3Format)


def test_config_loads_from_yaml_and_overrides(tmp_path):
    from jaxrl.config import ConfigError, load_config

    @dataclasses.dataclass(frozen=True)
    class Schema:
        tools: ToolsConfig = dataclasses.field(default_factory=ToolsConfig)

    path = tmp_path / "c.yaml"
    path.write_text("tools:\n  names: [calculator, python]\n  format: hermes\n")
    config = load_config(Schema, path, ["tools.python_timeout_s=3"]).tools
    assert config == ToolsConfig(names=["calculator", "python"], format="hermes",
                                 python_timeout_s=3.0)
    with pytest.raises(ConfigError, match="tools.format"):
        load_config(Schema, path, ["tools.format=json"])


@pytest.mark.parametrize("kwargs, message", [
    ({"names": []}, r"data.tools.names must be a non-empty list of distinct tools"),
    ({"names": ["shell"]}, r"names must be .* from \['calculator', 'python'\], got \['shell'\]"),
    ({"names": ["python", "python"]}, r"names must be a non-empty list of distinct"),
    ({"format": "json"}, r"data.tools.format must be one of .*, got 'json'"),
    ({"python_sandbox": "none"}, r"data.tools.python_sandbox must be one of"),
    ({"max_calls_per_turn": 0}, r"max_calls_per_turn must be an integer >= 1, got 0"),
    ({"python_timeout_s": -1.0}, r"python_timeout_s must be a finite number of seconds > 0"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ToolsConfig(**kwargs)


def test_tool_schema_for_chat_templates():
    assert tool_schema(Calculator()) == {
        "type": "function",
        "function": {"name": "calculator", "description": Calculator().description,
                     "parameters": {"type": "object",
                                    "properties": {"expression": {"type": "string"}},
                                    "required": ["expression"]}}}


def test_results_are_cut_to_max_result_chars():
    env = ToolEnv([Calculator()], TagsFormat(), max_result_chars=8)
    assert env.step("<call>1234*5678</call>").text == "<result>7006652</result>"
    cut = env.step("<call>12**</call>")
    assert cut.text == "<result>error: i</result>" and cut.tools.errors == 1
    whole = ToolEnv([Calculator()], TagsFormat()).step("<call>12**</call>")
    assert whole.text.startswith("<result>error: invalid syntax") and len(whole.text) > 30
    with pytest.raises(ValueError, match="max_result_chars must be an integer >= 1, or null"):
        ToolsConfig(max_result_chars=0)
