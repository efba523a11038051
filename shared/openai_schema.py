"""OpenAI-compatible request bodies and response shapes, mapped onto the Redis protocol.

The bodies take what OpenAI takes: `null` for an optional field means its default, and a field this service does
not know is ignored (the route logs it once per request, as vLLM does) rather than refused. Chat messages may be
`developer` (shown to the template as `system`), give their content as a list of text parts (joined with newlines,
as vLLM does; any other part is refused) and carry a `name` (accepted, not shown to the model). A completion's
prompt may be a batch: a list of strings or of token-id lists, one protocol request per prompt. Tool calls come
out of a grammar (tool_choice a named function or "required"; shared/openai_tools.py).
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from shared.openai_tools import ToolCalls
from shared.protocol import (
    ChatMessage,
    Completion,
    DoneEvent,
    GenerationRequest,
    PromptScores,
    SamplingExtras,
    SamplingOptions,
    StructuredOutputs,
    TokenId,
    TokenLogprob,
    ToolCall,
    ToolCallFunction,
    new_request_id,
)


def _drop_nulls(data: Any) -> Any:
    """OpenAI's `null` means "the default": drop it so the field's default applies."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Open(BaseModel):
    """A part of an OpenAI body: nulls are defaults, unknown fields are kept aside (model_extra)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _drop_nulls(data)


class StreamOptions(_Open):
    include_usage: bool = False  # a last chunk with empty choices and the usage


class JsonSchemaFormat(_Open):
    """response_format.json_schema: the output follows `schema` (always enforced, as with strict=true)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    name: str = Field("response", max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("response_format", "response_format: type json_schema needs a json_schema")
        return self

    def structured(self) -> StructuredOutputs | None:
        if self.type == "json_object" or self.type == "json_schema" and self.json_schema.schema_ is None:
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputs(json=self.json_schema.schema_)
        return None


# A function without `parameters` takes none (OpenAI's reading): its arguments are the empty object.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # calls follow the schema either way here


class Tool(_Open):
    """A tool a chat may call (calls come out of a grammar: shared/openai_tools.py)."""

    type: Literal["function"]
    function: FunctionDef

    def schema(self) -> dict[str, Any]:
        return self.function.parameters if self.function.parameters is not None else NO_PARAMETERS


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the protocol carries them to the chat template."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class _FunctionName(_Open):
    name: str


class NamedToolChoice(_Open):
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


class ContentPart(_Open):
    type: str
    text: str = ""


class FunctionCallIn(_Open):
    name: str = Field(max_length=256)
    arguments: str | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it (an object is taken too)


class ToolCallIn(_Open):
    """A call an earlier assistant turn made (OpenAI's message.tool_calls item)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def to_protocol(self) -> ToolCall:
        args = self.function.arguments
        return ToolCall(id=self.id, function=ToolCallFunction(
            name=self.function.name, arguments=args if isinstance(args, str) else json.dumps(args)))


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None only for an assistant turn (that called tools)
    name: str | None = None  # accepted; the chat template is not shown it
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=128)  # an assistant turn's calls
    tool_call_id: str | None = Field(None, max_length=256)  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _text_only(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "content: required in a {role} message", {"role": self.role})
        for i, part in enumerate(self.content if isinstance(self.content, list) else []):
            if part.type != "text":
                raise PydanticCustomError("content_part", "content part {i} has type '{kind}': only 'text' parts "
                                          "are supported (this model reads text)", {"i": i, "kind": part.type})
        return self

    def to_protocol(self) -> ChatMessage:
        text = "\n".join(p.text for p in self.content) if isinstance(self.content, list) else self.content or ""
        calls = [c.to_protocol() for c in self.tool_calls] if self.tool_calls else None
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text, tool_calls=calls,
                           tool_call_id=self.tool_call_id)


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _Body(SamplingExtras):
    """OpenAI's common body fields; the vLLM extras (top_k, min_p, mode, ...) come from SamplingExtras."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _drop_nulls(data)

    model: str
    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's routing hint for its prompt cache: requests with the same key go to the replica the key went to last
    prompt_cache_key: str | None = Field(None, max_length=256)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenId, float] | None = None  # token id -> bias in [-100, 100] (checked by the protocol)
    response_format: ResponseFormat | None = None
    # vLLM's older names for structured_outputs' json / regex / choice / grammar (extra body fields)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=1024)
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _one_grammar(self) -> _Body:
        given = [name for name in ("structured_outputs", *GUIDED) if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append(f"response_format ({self.response_format.type})")
        if len(given) > 1:
            raise PydanticCustomError("structured_outputs", "structured_outputs: give one way to constrain the "
                                      "output, got {given}", {"given": ", ".join(given)})
        return self

    def structured(self) -> StructuredOutputs | None:
        """The output's grammar, from whichever of the three spellings the body used."""
        if self.structured_outputs is not None:
            return self.structured_outputs
        if self.response_format is not None:
            return self.response_format.structured()
        for name, field in GUIDED.items():
            if getattr(self, name) is not None:
                return StructuredOutputs(**{field: getattr(self, name)})
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unknown_fields(self) -> list[str]:
        """The fields given that this service ignores (for the route's log line)."""
        extra = [*(self.model_extra or {})]
        if self.stream_options is not None:
            extra += [f"stream_options.{k}" for k in self.stream_options.model_extra or {}]
        if self.response_format is not None:
            extra += [f"response_format.{k}" for k in self.response_format.model_extra or {}]
            if (schema := self.response_format.json_schema) is not None:
                extra += [f"response_format.json_schema.{k}" for k in schema.model_extra or {}]
        return extra

    def _options(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        extras = self.model_dump(include=set(SamplingExtras.model_fields) - {"prompt_logprobs", "structured_outputs"})
        structured = self.structured()
        extras["structured_outputs"] = structured.model_dump() if structured is not None else None
        return SamplingOptions(n=self.n, temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=stop,
                               max_tokens=max_tokens, logprobs=logprobs, presence_penalty=self.presence_penalty,
                               frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias,
                               prompt_logprobs=prompt_logprobs, **extras)


class CompletionBody(_Body):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False  # the prompt before each completion (and its log-probs first, with logprobs)
    max_tokens: int = Field(16, ge=0)  # 0 only with echo: the prompt's log-probs, no completion
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, v):
        if isinstance(v, list) and (not v or any(p in ("", []) for p in v)):
            raise PydanticCustomError("prompt", "a batch needs at least one prompt, and no empty one")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _zero_with_echo(cls, v: int, info: ValidationInfo) -> int:
        if v == 0 and not info.data.get("echo"):
            raise PydanticCustomError("max_tokens", "0 needs echo=true (the prompt's log-probs, no completion)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise PydanticCustomError("suffix", "insertion (text after the completion) is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    def to_requests(self, response_id: str, client_id: str = "openai") -> list[GenerationRequest]:
        """One request per prompt: `response_id` itself for a single prompt, `response_id-i` in a batch."""
        prompts = self.prompts()
        ids = [response_id] if len(prompts) == 1 else [f"{response_id}-{i}" for i in range(len(prompts))]
        return [GenerationRequest(request_id=rid, prompt=p, model=self.model, client_id=client_id,
                                  params=self._options(max(self.max_tokens, 1), self.logprobs,
                                                       self._prompt_logprobs(p)))
                for rid, p in zip(ids, prompts)]

    def to_request(self, client_id: str = "openai") -> GenerationRequest:
        """The request of a single-prompt body."""
        (request,) = self.to_requests(f"cmpl-{new_request_id()}", client_id)
        return request

    def _prompt_logprobs(self, prompt: str | list[int]) -> int | None:
        # echo needs the prompt's log-probs with logprobs, and its text (from the replica) for a token-id prompt
        if self.echo and (self.logprobs is not None or not isinstance(prompt, str)):
            return max(self.logprobs or 0, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without (resolved)
    parallel_tool_calls: bool = True  # False: tool_choice "required" makes exactly one call

    @model_validator(mode="after")
    def _tools(self) -> ChatBody:
        if (why := check_tools(self.tools, self.tool_choice)) is not None:
            raise PydanticCustomError("tool_choice", why)
        if self.tool_calls() is not None and (other := super().structured()) is not None:
            raise PydanticCustomError("structured_outputs", "structured_outputs: tool calls follow their tools' "
                                      "schemas; a second constraint ({other}) cannot apply too",
                                      {"other": ", ".join(k for k, v in other.model_dump().items() if v)})
        return self

    def tool_calls(self) -> ToolCalls | None:
        """How the reply's output becomes tool calls (None: it is text)."""
        choice = resolved(self.tools, self.tool_choice)
        if isinstance(choice, NamedToolChoice):
            return ToolCalls(choice.function.name)
        return ToolCalls(None) if choice == "required" else None

    def structured(self) -> StructuredOutputs | None:
        if self.tools and (schema := call_schema(self.tools, resolved(self.tools, self.tool_choice),
                                                 self.parallel_tool_calls)) is not None:
            return StructuredOutputs(json=schema)
        return super().structured()

    def unknown_fields(self) -> list[str]:
        extra = super().unknown_fields()
        for i, tool in enumerate(self.tools or ()):
            extra += [f"tools[{i}].{k}" for k in tool.model_extra or {}]
            extra += [f"tools[{i}].function.{k}" for k in tool.function.model_extra or {}]
        return extra

    def to_request(self, default_max_tokens: int, client_id: str = "openai") -> GenerationRequest:
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return GenerationRequest(request_id=f"chatcmpl-{new_request_id()}", model=self.model, client_id=client_id,
                                 messages=[m.to_protocol() for m in self.messages], tools=tool_dicts(self.tools),
                                 params=self._options(max_tokens, logprobs, self.prompt_logprobs))


class TokenizeBody(_Open):
    """vLLM's /tokenize: a `prompt` (text), or `messages` (and `tools`) through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    add_generation_prompt: bool = True  # messages: end ready for the assistant's turn
    add_special_tokens: bool | None = None  # None: as the engine tokenises a request (the tokenizer's default)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("prompt", "give exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise PydanticCustomError("tools", "tools need messages")
        return self

    def to_request(self) -> GenerationRequest:
        if self.messages is None:
            return GenerationRequest(prompt=self.prompt)
        return GenerationRequest(messages=[m.to_protocol() for m in self.messages], tools=tool_dicts(self.tools))


class DetokenizeBody(_Open):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


# ---- responses
def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict:
    """OpenAI's completion logprobs. An entry without alternatives (the prompt's first token) has top null."""
    tokens = [e.token for e in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tok: lp for _, tok, lp in e.top} if e.top else None for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    def item(tok: str, lp: float | None) -> dict:
        return {"token": tok, "logprob": lp if lp is not None else -9999.0, "bytes": list(tok.encode())}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(tok, lp) for _, tok, lp in e.top]}
                        for e in entries]}


def vllm_prompt_logprobs(scores: PromptScores) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: None, then per prompt token {id: {logprob, decoded_token}}."""
    return [None] + [{str(t): {"logprob": lp, "decoded_token": tok} for t, tok, lp in e.top}
                     for e in scores.logprobs[1:]]


def usage(dones: list[DoneEvent], generated: bool = True) -> dict:
    """Summed over a batch's prompts; `generated` False: echo with max_tokens=0 (the engine's token dropped)."""
    prompt = sum(d.metrics.prompt_tokens for d in dones)
    completion = sum(len(c.token_ids) for d in dones for c in d.outputs) if generated else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(d.metrics.cached_prompt_tokens for d in dones)}}


def completion_choice(index: int, c: Completion, want_logprobs: bool, echo: str | None = None,
                      prompt: PromptScores | None = None, generated: bool = True) -> dict:
    """One choice; with `echo` (the prompt's text) the text and log-probs start with the prompt's."""
    entries = None
    if want_logprobs:
        entries = [*(prompt.logprobs if echo is not None and prompt is not None else []),
                   *((c.logprobs or []) if generated else [])]
    return {"index": index, "text": (echo or "") + (c.text if generated else ""),
            "logprobs": completion_logprobs(entries) if entries is not None else None,
            "finish_reason": c.finish_reason}


def completion_response(rid: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_}


def chat_response(rid: str, model: str, done: DoneEvent, want_logprobs: bool, tools: ToolCalls | None = None) -> dict:
    def choice(c: Completion) -> dict:
        lp = chat_logprobs(c.logprobs) if want_logprobs and c.logprobs is not None else None
        if tools is None:
            return {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        return {"index": c.index, "message": tools.message(c.text), "logprobs": lp,
                "finish_reason": tools.finish_reason(c.finish_reason)}

    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice(c) for c in done.outputs], "usage": usage([done])}


def completion_chunk(rid: str, model: str, index: int, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, chat: bool, usage_: dict) -> dict:
    """stream_options.include_usage: the last chunk, with no choices."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage_}
