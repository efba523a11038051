"""OpenAI tool calling without a model-specific parser: the calls come out of a grammar, as vLLM's named and
`required` tool choices do.

- `tool_choice` a named function: the output is that function's arguments, a JSON object following its
  `parameters` schema; the reply is one call to it (finish_reason `stop`, as OpenAI answers a forced function).
- `tool_choice: "required"`: the output is a JSON array of `{"name", "parameters"}`, each a tool of the request
  with arguments following its schema; one or more calls (one with `parallel_tool_calls: false`), finish_reason
  `tool_calls`.
- `"none"`: plain text (the tools still reach the chat template, as vLLM passes them).
- `"auto"` (the default with tools) would need a parser of the model's own tool-call format (Hermes' `<tool_call>`,
  Llama 3's JSON, ...): refused with a 400, as vLLM refuses it without `--tool-call-parser`.

The grammar guarantees each call parses and follows its schema, not that it is a good call.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A function without `parameters` takes none (OpenAI's reading): its arguments are the empty object.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class FunctionDef(_Part):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # calls follow the schema either way here


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDef

    def schema(self) -> dict[str, Any]:
        return self.function.parameters if self.function.parameters is not None else NO_PARAMETERS


class _FunctionName(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> str | None:
    """Why this tools / tool_choice pair cannot be served (a 400's message), or None."""
    names = [t.function.name for t in tools or ()]
    if len(set(names)) < len(names):
        return "tools: two tools have the same name"
    choice = resolved(tools, choice)
    if choice == "auto":
        return ("tool_choice 'auto' (the default when tools are given) needs a parser of the model's own tool-call "
                "format, which this server does not have: pass tool_choice 'required' or a named function (calls "
                "then come out of a grammar and always follow their schema), or 'none'")
    if choice != "none" and not names:
        return "tool_choice: a tool call needs tools"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return f"tool_choice: no tool named {choice.function.name!r} in tools"
    return None


def resolved(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    return choice if choice is not None else ("auto" if tools else "none")


def call_schema(tools: list[Tool], choice: ToolChoice, parallel: bool = True) -> dict[str, Any] | None:
    """The JSON schema the output follows (None: free text)."""
    if isinstance(choice, NamedToolChoice):
        return next(t.schema() for t in tools if t.function.name == choice.function.name)
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"enum": [t.function.name]}, "parameters": t.schema()},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolCalls:
    """How one chat reply's output becomes tool calls. `name`: the named function; None: tool_choice "required"."""

    name: str | None

    def message(self, text: str) -> dict:
        """A finished choice's assistant message."""
        if self.name is not None:
            return {"role": "assistant", "content": None, "tool_calls": [tool_call(self.name, text)]}
        try:
            calls = [_name_and_arguments(element) for element in _members(text.strip(), "[", "]")]
        except ValueError:  # cut at max_tokens before the array closed: what came, as text
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": None,
                "tool_calls": [tool_call(name, arguments) for name, arguments in calls]}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.name is None and reason == "stop" else reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.name)


@dataclass
class ToolCallStream:
    """One streamed choice's text -> `delta.tool_calls` entries. A named function's arguments stream as they come
    (the first entry carries the call's id and name); with "required" each call is sent whole once the array's
    element closes (its name is only known then). Text after the last whole call is dropped: the grammar allows
    none but an output cut at max_tokens (finish_reason `length`)."""

    name: str | None
    call_id: str = field(default_factory=new_call_id)
    sent: int = 0  # calls sent ("required"), or 1 once the named call's first entry went
    _buffer: str = ""
    _depth: int = 0  # of [ and { outside strings, in the array ("required")
    _in_string: bool = False
    _escaped: bool = False
    _start: int = -1  # where the element being read began in _buffer

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.name is not None:
            if self.sent:
                return [{"index": 0, "function": {"arguments": text}}]
            self.sent = 1
            return [{"index": 0, **tool_call(self.name, text, self.call_id)}]
        out = []
        for ch in text:
            self._buffer += ch
            if self._in_string:  # brackets in strings do not count
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._start = len(self._buffer) - 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and self._start >= 0:
                    name, arguments = _name_and_arguments(self._buffer[self._start:])
                    out.append({"index": self.sent, **tool_call(name, arguments)})
                    self.sent += 1
                    self._buffer, self._start = "", -1
        return out


_DECODER = json.JSONDecoder()


def _members(text: str, open_: str, close: str) -> list[str]:
    """The raw texts of a JSON array's elements (or of an object's keys and values, in turn), as written:
    re-encoding parsed values would change them (a number beyond float's range becomes `Infinity`, not JSON)."""
    if not text.startswith(open_):
        raise ValueError(f"not a JSON {open_}...{close}")
    out, pos = [], _skip(text, 1)
    if text.startswith(close, pos):
        return out
    while True:
        if open_ == "{":
            key, pos = _DECODER.raw_decode(text, pos)
            pos = _skip(text, pos)
            if not text.startswith(":", pos):
                raise ValueError("expected ':'")
            out.append(key)
            pos = _skip(text, pos + 1)
        _, end = _DECODER.raw_decode(text, pos)
        out.append(text[pos:end])
        pos = _skip(text, end)
        if text.startswith(close, pos):
            return out
        if not text.startswith(",", pos):
            raise ValueError(f"expected ',' or {close!r}")
        pos = _skip(text, pos + 1)


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def _name_and_arguments(element: str) -> tuple[str, str]:
    """A "required" call `{"name": ..., "parameters": {...}}` -> its name and its arguments' JSON text."""
    pairs = _members(element.strip(), "{", "}")
    fields = dict(zip(pairs[::2], pairs[1::2]))
    return json.loads(fields["name"]), fields["parameters"]
