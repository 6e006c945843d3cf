"""Tool-call formats: how a model writes a call in its turn, and how the results come back.

A format parses the model's turn (decoded text, stop tag included) into calls, names the
strings that end a tool-calling turn (the rollout stops decoding on them), and renders the
tools' results as the observation text appended after the turn:

    hermes  (Qwen2.5 / Qwen3 chat templates)
        turn:   ...<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2+2"}}\\n</tool_call>
        obs:    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n4\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
        (one `\\n<tool_response>\\n...\\n</tool_response>` per result, as Qwen's template groups
        consecutive tool messages into one user turn; the turn stops on `</tool_call>`, so the
        observation closes the assistant turn with `<|im_end|>` itself)
    llama3  (Llama 3.1 / 3.2 JSON tool calling)
        turn:   [<|python_tag|>]{"name": "calculator", "parameters": {"expression": "2+2"}}<|eom_id|>
                <|python_tag|>print(2+2)<|eom_id|>     (3.1's code interpreter: a python call)
        obs:    <|start_header_id|>ipython<|end_header_id|>\\n\\n4<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n
        (one ipython message per result; a turn is a call only when its text, after any
        `<|python_tag|>`, starts with `{`, or when it has that tag: otherwise it is the answer.
        The result text is written as is, as in Meta's prompt-format guide; HF's template
        JSON-quotes string contents.)
    tags    (plain text, for models without a tool template, e.g. tiny char-level ones)
        turn:   ...<call>2+2</call>            the only tool configured, the text its argument
                ...<call>python print(1)</call> a tool by name: the first word, when a tool has it
        obs:    <result>4</result>

A malformed call (bad JSON, no name, an unclosed tag) is a `ToolCallError` in the parsed
list, never an exception: the environment answers it with an error observation, so the
policy sees what it got wrong. `format_for(tokenizer)` picks hermes or llama3 from what the
chat template mentions, else tags; a template with `<tool_call>` on Llama tokens (Hermes-2-Pro
on Llama 3) would need its own format.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from jaxrl.envs.tools import ToolResult

FormatName = Literal["hermes", "llama3", "tags"]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name (None: the tags format's unnamed call, meaning the only tool
    configured) and its arguments."""

    name: str | None
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call the model wrote that cannot be parsed; `message` says why (shown to the policy)."""

    message: str


ParsedCall = ToolCall | ToolCallError


class ToolCallFormat(Protocol):
    end_tags: tuple[str, ...]  # strings that end a tool-calling turn: the rollout stops on them

    def parse(self, turn: str) -> list[ParsedCall]:
        """The calls of a turn, in order ([] when it has none: the final answer)."""
        ...

    def render_results(self, results: Sequence[ToolResult]) -> str:
        """The observation text that carries `results` back to the model."""
        ...


def _tagged_bodies(turn: str, open_tag: str, close_tag: str) -> list[str | ToolCallError]:
    """The texts between open_tag and close_tag, and an error for an open tag left unclosed."""
    bodies: list[str | ToolCallError] = []
    start = turn.find(open_tag)
    while start >= 0:
        end = turn.find(close_tag, start + len(open_tag))
        if end < 0:
            bodies.append(ToolCallError(f"{open_tag} without {close_tag}"))
            break
        bodies.append(turn[start + len(open_tag):end])
        start = turn.find(open_tag, end + len(close_tag))
    return bodies


def _json_call(text: str, arguments_key: str) -> ParsedCall:
    """{"name": str, arguments_key: object (or a JSON string of one)} -> the call, or why not."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos}); "
                             f'expected {{"name": ..., "{arguments_key}": {{...}}}}')
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError(f'the tool call has no "name" string; expected '
                             f'{{"name": ..., "{arguments_key}": {{...}}}}')
    # Llama models write "parameters" or "arguments" (as do Qwen's, rarely): take either.
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # Qwen's template accepts arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCallError(f'"{arguments_key}" of the call to {obj["name"]!r} must be a JSON '
                             f"object, got {type(arguments).__name__}")
    return ToolCall(obj["name"], arguments)


@dataclasses.dataclass(frozen=True)
class HermesFormat:
    """Qwen2.5 / Qwen3 `<tool_call>` JSON calls, results as a user turn of `<tool_response>`s.
    `generation_prompt` opens the next assistant turn (Qwen3 with thinking off: append
    "<think>\\n\\n</think>\\n\\n")."""

    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"
    generation_prompt: str = "<|im_start|>assistant\n"

    @property
    def end_tags(self) -> tuple[str, ...]:
        return (self.close_tag,)

    def parse(self, turn: str) -> list[ParsedCall]:
        return [body if isinstance(body, ToolCallError) else _json_call(body.strip(), "arguments")
                for body in _tagged_bodies(turn, self.open_tag, self.close_tag)]

    def render_results(self, results: Sequence[ToolResult]) -> str:
        responses = "".join(f"\n<tool_response>\n{r.text}\n</tool_response>" for r in results)
        return f"<|im_end|>\n<|im_start|>user{responses}<|im_end|>\n{self.generation_prompt}"


@dataclasses.dataclass(frozen=True)
class Llama3Format:
    """Llama 3.1 / 3.2 JSON calls (the whole turn, optionally after `<|python_tag|>`), results
    as `ipython` messages. Code after `<|python_tag|>` (Llama 3.1's built-in code interpreter)
    is a call of the tool `code_tool`."""

    end_tags: tuple[str, ...] = ("<|eom_id|>", "<|eot_id|>")
    python_tag: str = "<|python_tag|>"
    code_tool: str = "python"  # runs the code after python_tag that is not a JSON call

    def parse(self, turn: str) -> list[ParsedCall]:
        body = turn.rstrip()
        for tag in self.end_tags:
            if body.endswith(tag):
                body = body[:-len(tag)]
                break
        tagged = self.python_tag in body
        if tagged:
            body = body.rsplit(self.python_tag, 1)[1]
        body = body.strip()
        if body.startswith("{"):
            return [_json_call(body, "parameters")]
        # Llama 3.1's built-in code interpreter: <|python_tag|>CODE<|eom_id|>.
        return [ToolCall(self.code_tool, {"code": body})] if tagged and body else []

    def render_results(self, results: Sequence[ToolResult]) -> str:
        messages = "".join(f"<|start_header_id|>ipython<|end_header_id|>\n\n{r.text}<|eot_id|>"
                           for r in results)
        return f"{messages}<|start_header_id|>assistant<|end_header_id|>\n\n"


@dataclasses.dataclass(frozen=True)
class TagsFormat:
    """`<call>[NAME ]ARGS</call>` -> `<result>TEXT</result>`. The first word names the tool when
    it is one of `tool_names`; otherwise the call is unnamed (the only tool) and the whole text
    is its argument (under "input")."""

    open_tag: str = "<call>"
    close_tag: str = "</call>"
    result_open: str = "<result>"
    result_close: str = "</result>"
    tool_names: tuple[str, ...] = ()

    @property
    def end_tags(self) -> tuple[str, ...]:
        return (self.close_tag,)

    def parse(self, turn: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        for body in _tagged_bodies(turn, self.open_tag, self.close_tag):
            if isinstance(body, ToolCallError):
                calls.append(body)
                continue
            body = body.strip()
            first, *rest = body.split(None, 1) or [""]
            if first in self.tool_names:
                calls.append(ToolCall(first, {"input": rest[0] if rest else ""}))
            else:
                calls.append(ToolCall(None, {"input": body}))
        return calls

    def render_results(self, results: Sequence[ToolResult]) -> str:
        return "".join(f"{self.result_open}{r.text}{self.result_close}" for r in results)


def make_format(name: FormatName) -> ToolCallFormat:
    """The format `name` with its default tags."""
    formats: dict[str, type] = {"hermes": HermesFormat, "llama3": Llama3Format,
                                "tags": TagsFormat}
    if name not in formats:
        raise ValueError(f"unknown tool-call format {name!r}; expected one of {sorted(formats)}")
    return formats[name]()


def format_for(tokenizer_or_template: Any) -> ToolCallFormat:
    """hermes when the chat template mentions `<tool_call>`, llama3 when it mentions
    `<|python_tag|>` or `ipython`, else tags. Takes a tokenizer (its `chat_template`, which may
    be None or a dict of named templates), the template text, or None."""
    template = tokenizer_or_template
    if not isinstance(template, str | None):
        template = getattr(template, "chat_template", None)
    if isinstance(template, Mapping):
        template = "\n".join(str(t) for t in template.values())
    text = template or ""
    if "<tool_call>" in text:
        return HermesFormat()
    if "<|python_tag|>" in text or "ipython" in text:
        return Llama3Format()
    return TagsFormat()
