"""Tool-call formats: parse what a model writes, render results as its chat template would."""

import pytest

from jaxrl.envs.tool_calls import (
    HermesFormat,
    Llama3Format,
    TagsFormat,
    ToolCall,
    ToolCallError,
    format_for,
    make_format,
)
from jaxrl.envs.tools import ToolResult

RESULTS = [ToolResult("4"), ToolResult("error: division by zero", error=True)]


def test_hermes_parses_qwen_tool_calls():
    # As Qwen's template renders an assistant message with two tool_calls.
    turn = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "2+2"}}\n</tool_call>\n<tool_call>\n{"name": "python", '
            '"arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    assert HermesFormat().parse(turn) == [ToolCall("calculator", {"expression": "2+2"}),
                                          ToolCall("python", {"code": "print(1)"})]
    assert HermesFormat().parse("The answer is 4.<|im_end|>") == []
    assert HermesFormat().end_tags == ("</tool_call>",)


def test_hermes_renders_results_as_qwen_tool_messages():
    assert HermesFormat().render_results(RESULTS) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n"
        "error: division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    thinking_off = HermesFormat(generation_prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert thinking_off.render_results(RESULTS[:1]).endswith(
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("body, why", [
    ('{"name": "calculator", "arguments": {"expression": "2+2"}', "not valid JSON"),
    ('{"arguments": {"expression": "2+2"}}', 'no "name"'),
    ('["calculator"]', 'no "name"'),
    ('{"name": "calculator", "arguments": [1, 2]}', "must be a JSON object, got list"),
])
def test_hermes_malformed_calls_are_error_values(body, why):
    (call,) = HermesFormat().parse(f"<tool_call>\n{body}\n</tool_call>")
    assert isinstance(call, ToolCallError)
    assert why in call.message


def test_unclosed_tag_is_an_error_value_after_the_complete_calls():
    turn = '<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{"name": "b"'
    first, second = HermesFormat().parse(turn)
    assert first == ToolCall("a", {})
    assert second == ToolCallError("<tool_call> without </tool_call>")


def test_llama3_parses_json_calls_and_leaves_answers_alone():
    fmt = Llama3Format()
    call = ToolCall("calculator", {"expression": "2+2"})
    assert fmt.parse('{"name": "calculator", "parameters": {"expression": "2+2"}}<|eom_id|>') \
        == [call]
    assert fmt.parse('<|python_tag|>{"name": "calculator", "parameters": '
                     '{"expression": "2+2"}}<|eot_id|>') == [call]
    assert fmt.parse("The answer is 4.<|eot_id|>") == []
    assert fmt.parse("<|python_tag|>print(2 + 2)\n<|eom_id|>") == \
        [ToolCall("python", {"code": "print(2 + 2)"})]
    (bad,) = fmt.parse('{"name": "calculator", "parameters": {"expression"<|eom_id|>')
    assert isinstance(bad, ToolCallError) and "not valid JSON" in bad.message
    assert fmt.end_tags == ("<|eom_id|>", "<|eot_id|>")


def test_llama3_renders_ipython_messages():
    assert Llama3Format().render_results(RESULTS) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n4<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\nerror: division by zero<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tags_unnamed_and_named_calls():
    assert TagsFormat().parse("so <call> 12*3 </call>") == [ToolCall(None, {"input": "12*3"})]
    named = TagsFormat(tool_names=("python", "calculator"))
    assert named.parse("<call>python print(1)\nprint(2)</call><call>calculator\n1+1</call>"
                       "<call>7*6</call>") == [ToolCall("python", {"input": "print(1)\nprint(2)"}),
                                               ToolCall("calculator", {"input": "1+1"}),
                                               ToolCall(None, {"input": "7*6"})]
    assert TagsFormat().parse("no call here") == []
    assert TagsFormat().parse("<call>1+") == [ToolCallError("<call> without </call>")]
    assert TagsFormat().render_results(RESULTS) == \
        "<result>4</result><result>error: division by zero</result>"


def test_tags_strings_are_configurable():
    fmt = TagsFormat(open_tag="[[", close_tag="]]", result_open="=> ", result_close="\n")
    assert fmt.end_tags == ("]]",)
    assert fmt.parse("[[1+1]]") == [ToolCall(None, {"input": "1+1"})]
    assert fmt.render_results(RESULTS[:1]) == "=> 4\n"


class _Tokenizer:
    def __init__(self, chat_template):
        self.chat_template = chat_template


def test_format_for_reads_the_chat_template():
    qwen = "{{- '<tool_call>\\n{\"name\": \"' }}{{- '<|im_start|>user' }}"
    llama = "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}<|python_tag|>"
    assert isinstance(format_for(qwen), HermesFormat)
    assert isinstance(format_for(_Tokenizer(llama)), Llama3Format)
    assert isinstance(format_for(_Tokenizer({"default": "x", "tool_use": qwen})), HermesFormat)
    assert isinstance(format_for(_Tokenizer(None)), TagsFormat)
    assert isinstance(format_for(None), TagsFormat)
    assert isinstance(format_for("{{ message.content }}"), TagsFormat)


def test_make_format():
    assert isinstance(make_format("llama3"), Llama3Format)
    with pytest.raises(ValueError, match="'json'.*'hermes', 'llama3', 'tags'"):
        make_format("json")
