"""A request as one replica holds it, and the typed records its threads pass to each other.

Commands go to the engine thread (the only one that touches the engine); outbox items go to the publisher
thread (the only one that writes results and events to Redis).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_service.engine.kv_transfer import KVBlocks
from engine_service.engine.roofline import StepRecord
from shared.protocol import GenerationRequest, PromptScores


@dataclass(eq=False)
class Job:
    request: GenerationRequest
    entry_id: str
    attempt: int
    picked_at: float
    stream: str  # the stream the entry came from: the shared one or a replica's (routed)
    seq: int = 0
    sent: dict[int, tuple[str, list[int]]] = field(default_factory=dict)  # index -> (text, token ids) published
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_tokens: int = 0
    cancelled: bool = False
    started: bool = False
    spec: dict | None = None  # the engine's speculative counters (RequestMetrics.spec), latest
    prompt: PromptScores | None = None  # params.prompt_logprobs, once the engine has scored the prompt
    cached_prompt_tokens: int = 0  # the engine's RequestMetrics.cached_prompt_tokens
    prefill_only: bool = False  # a prefill replica computes its prompt, then hands it over (no tokens sent)
    kv: KVBlocks | None = None  # decode side: the blocks a prefill replica sent, until the engine thread imports them
    handover: dict | None = None  # decode side: from, blocks, bytes, transfer_ms, imported_tokens (DoneEvent metrics)
    logprob_memo: dict = field(default_factory=dict)  # events.token_logprobs' records by engine entry

    @property
    def rid(self) -> str:
        return self.request.request_id

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1


# ---- commands for the engine thread
@dataclass(frozen=True)
class Add:
    job: Job


@dataclass(frozen=True)
class Cancel:
    job: Job


@dataclass(frozen=True)
class Drop:
    """Another replica claimed the request: stop running it here without answering."""

    job: Job


Command = Add | Cancel | Drop


# ---- items for the publisher thread
@dataclass(frozen=True)
class Publish:
    request_id: str
    payload: str  # an encoded TokenEvent


@dataclass(frozen=True)
class StoreSnapshot:
    key: str
    payload: str  # an encoded KVSnapshot


@dataclass(frozen=True)
class AppendSteps:
    key: str
    records: list[StepRecord]  # the engine's, oldest first (encoded by the publisher, off the engine thread)


@dataclass(frozen=True)
class KVEvents:
    """Block hashes (shared.routing names) that entered and left the prefix cache, in order."""

    events: list[tuple[bool, str]]  # (stored?, name)


@dataclass(frozen=True)
class KVSync:
    """Every block hash the prefix cache holds: replaces the published set (start, or Redis lost it)."""

    names: list[str]


@dataclass(frozen=True)
class HandOver:
    """A prefilled request: its blocks go to the KV connector, its entry to a decode replica's stream."""

    job: Job
    blocks: KVBlocks


@dataclass(frozen=True)
class Finish:
    request_id: str
    entry_id: str
    stream: str
    payload: str  # the encoded terminal event: stored as the result, published, the entry acknowledged
    client_id: str


OutboxItem = Publish | StoreSnapshot | AppendSteps | KVEvents | KVSync | HandOver | Finish
