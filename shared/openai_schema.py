"""OpenAI-compatible request bodies and response shapes, mapped onto the Redis protocol."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, field_validator

from shared.protocol import (ChatMessage, Completion, DoneEvent, GenerationRequest, SamplingExtras, SamplingOptions,
                             TokenLogprob, new_request_id)


class _Body(SamplingExtras):
    """OpenAI's common body fields; the vLLM extras (top_k, min_p, mode, ...) come from SamplingExtras."""

    model: str
    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    frequency_penalty: float = 0.0  # accepted for compatibility; only 0 is supported
    presence_penalty: float = 0.0

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _zero_only(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("not supported (use repetition_penalty)")
        return v

    def _options(self, max_tokens: int, logprobs: int | None) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        extras = self.model_dump(include=set(SamplingExtras.model_fields))
        return SamplingOptions(n=self.n, temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=stop,
                               max_tokens=max_tokens, logprobs=logprobs, **extras)


class CompletionBody(_Body):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False

    def to_request(self, client_id: str = "openai") -> GenerationRequest:
        return GenerationRequest(request_id=f"cmpl-{new_request_id()}", prompt=self.prompt, model=self.model,
                                 params=self._options(self.max_tokens, self.logprobs), client_id=client_id)


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def to_request(self, default_max_tokens: int, client_id: str = "openai") -> GenerationRequest:
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return GenerationRequest(request_id=f"chatcmpl-{new_request_id()}", messages=self.messages, model=self.model,
                                 params=self._options(max_tokens, logprobs), client_id=client_id)


# ---- responses
def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict:
    tokens = [e.token for e in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tok: lp for _, tok, lp in e.top} for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    def item(tok: str, lp: float | None) -> dict:
        return {"token": tok, "logprob": lp if lp is not None else -9999.0, "bytes": list(tok.encode())}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(tok, lp) for _, tok, lp in e.top]}
                        for e in entries]}


def usage(done: DoneEvent) -> dict:
    completion = sum(len(c.token_ids) for c in done.outputs)
    return {"prompt_tokens": done.metrics.prompt_tokens, "completion_tokens": completion,
            "total_tokens": done.metrics.prompt_tokens + completion}


def completion_response(rid: str, model: str, done: DoneEvent, want_logprobs: bool) -> dict:
    def choice(c: Completion) -> dict:
        lp = completion_logprobs(c.logprobs) if want_logprobs and c.logprobs is not None else None
        return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}

    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice(c) for c in done.outputs], "usage": usage(done)}


def chat_response(rid: str, model: str, done: DoneEvent, want_logprobs: bool) -> dict:
    def choice(c: Completion) -> dict:
        lp = chat_logprobs(c.logprobs) if want_logprobs and c.logprobs is not None else None
        return {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                "finish_reason": c.finish_reason}

    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice(c) for c in done.outputs], "usage": usage(done)}


def completion_chunk(rid: str, model: str, index: int, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
