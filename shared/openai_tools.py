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

The grammar guarantees each call parses and follows its schema, not that it is a good call. The request side (the
tools, the choice, the grammar's schema) is shared/openai_schema.py's; this file turns the output into calls.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


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
