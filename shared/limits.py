"""Service limits, checked before a request reaches an engine (replica intake, OpenAI endpoints, submit script)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from shared.protocol import GenerationRequest

ENV = {
    "max_request_bytes": "DECODELAB_MAX_REQUEST_BYTES",  # the request JSON on the stream / the HTTP body
    "max_prompt_bytes": "DECODELAB_MAX_PROMPT_BYTES",  # prompt text, or the chat messages' contents together
    "max_prompt_tokens": "DECODELAB_MAX_PROMPT_TOKENS",  # after tokenisation (the replica counts text prompts)
    "max_n": "DECODELAB_MAX_N",
    "max_beam_width": "DECODELAB_MAX_BEAM_WIDTH",
    "max_per_client": "DECODELAB_MAX_PER_CLIENT",  # requests of one client_id queued or running at once; 0: no limit
}


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 2 << 20
    max_prompt_bytes: int = 256 << 10
    max_prompt_tokens: int = 32768
    max_n: int = 16
    max_beam_width: int = 8
    max_per_client: int = 64

    @classmethod
    def from_env(cls) -> Limits:
        return cls(**{f.name: int(os.environ[ENV[f.name]]) for f in fields(cls) if os.environ.get(ENV[f.name])})

    def over(self, name: str, value: int, field_: str, unit: str = "") -> str | None:
        """`prompt: 300000 bytes is above this service's limit of 262144 (DECODELAB_MAX_PROMPT_BYTES)`, or None."""
        limit = getattr(self, name)
        if value > limit:
            return f"{field_}: {value}{unit} is above this service's limit of {limit} ({ENV[name]})"
        return None

    def check(self, request: GenerationRequest) -> str | None:
        """Why the request is refused (one line), or None. Text prompts are counted in tokens by the replica."""
        p = request.params
        if isinstance(request.prompt, str):
            size = len(request.prompt.encode())
        elif request.messages is not None:
            size = sum(len(m.content.encode()) for m in request.messages)
        else:
            size = 0
        return (self.over("max_prompt_bytes", size, "prompt", " bytes")
                or (isinstance(request.prompt, list) and self.check_prompt_tokens(len(request.prompt)))
                or self.over("max_n", p.n, "n")
                or (p.mode == "beam" and self.over("max_beam_width", p.beam_width, "beam_width"))
                or None)

    def check_prompt_tokens(self, num_tokens: int) -> str | None:
        return self.over("max_prompt_tokens", num_tokens, "prompt", " tokens")

    def check_size(self, num_bytes: int) -> str | None:
        return self.over("max_request_bytes", num_bytes, "request", " bytes of JSON")
