"""Wire protocol between clients (web, OpenAI API) and engine replicas: Pydantic models, JSON only."""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

PROTOCOL_VERSION = 1

Mode = Literal["greedy", "sample", "beam", "speculative"]
ErrorCode = Literal[
    "invalid_request",      # the replica (or engine) refused the request's content
    "limit_exceeded",       # above a service limit (shared/limits.py): prompt size, n, beam width
    "unsupported_version",  # protocol version mismatch
    "queue_full",           # backpressure: refused at submit time
    "deadline_exceeded",    # dropped before or during generation
    "engine_error",         # the engine raised while running it
    "lost",                 # Redis lost the request (e.g. restarted without persistence)
    "timeout",              # the client gave up waiting
    "unavailable",          # Redis unreachable
    "too_many_attempts",    # replicas died running it max_attempts times: moved to the dead-letter stream
    "failover_diverged",    # re-run after a replica died, the new run's text differs from what was streamed
]


# A vocabulary id. The replica checks it against its model's vocabulary; this bound keeps every id a non-negative
# 32-bit int before that (a router hashes prompt ids as int64: a larger int was a 500, found by the API fuzz test).
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs`: constrain the output to a grammar. Exactly one of `json` (a JSON schema),
    `regex`, `choice`, `grammar` (EBNF) or `json_object=true`; the engine checks and compiles it (xgrammar)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, serialize_by_alias=True, validate_by_name=True,
                              validate_by_alias=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = Field(None, max_length=1024)
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False


class SamplingExtras(_Model):
    """The vLLM sampling fields beyond OpenAI's (the OpenAI endpoints accept them as extra body fields)."""

    top_k: int = Field(-1, ge=-1, lt=1 << 31)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the matched stop string / stop token's text in the output
    min_tokens: int = Field(0, ge=0)
    mode: Mode | None = None
    beam_width: int = Field(1, ge=1, le=64)
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)  # len ** penalty must stay a finite float
    early_stopping: bool | Literal["never"] = False
    proposer: Literal["draft", "ngram"] = "ngram"
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    speculative_schedule: Literal["constant", "heuristic"] = "constant"  # SamplingParams.speculative_schedule
    ngram_min: int = Field(1, ge=1, le=16)
    ngram_max: int = Field(3, ge=1, le=16)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # DoneEvent.prompt_logprobs (the OpenAI API's echo)
    structured_outputs: StructuredOutputs | None = None  # grammar-constrained decoding, in every mode


class SamplingOptions(SamplingExtras):
    """Sampling parameters with vLLM names; the engine's SamplingParams re-validates them."""

    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)  # what torch.Generator.manual_seed takes
    stop: list[str] = Field(default_factory=list, max_length=16)
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI's: on generated tokens only
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=1024)
    # the sampler pipeline per generated token (TokenEvent.stages): each stage's top-N tokens; 0: off. Greedy and
    # sample modes; not an OpenAI API field (its responses have no place for it)
    sampler_stages: int = Field(0, ge=0, le=64)


class ToolCallFunction(_Model):
    name: str = Field(max_length=256)
    arguments: str  # JSON text, as OpenAI gives it


class ToolCall(_Model):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # an assistant turn that called tools
    tool_call_id: str | None = Field(None, max_length=256)  # a tool turn: the call it answers

    def for_template(self) -> dict:
        """The message as Hugging Face chat templates read it: tool calls' arguments as objects, not JSON text
        (the templates of Qwen2.5, Llama 3.1, Hermes write them with `tojson`), as vLLM hands them over."""
        out = self.model_dump(exclude_none=True)
        for call in out.get("tool_calls", ()):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the text
        return out


REQUEST_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"


def validation_message(errors: list[dict], skip_loc: int = 0, what: str = "request") -> str:
    """Pydantic errors as one short line: `params.temperature: Input should be a finite number; ...`."""
    return "; ".join(f"{'.'.join(str(x) for x in err['loc'][skip_loc:]) or what}: {err['msg']}" for err in errors[:5])


def new_request_id() -> str:
    return uuid.uuid4().hex


class Continuation(_Model):
    """Tokens appended after the prompt (or the templated messages) before generating: the playground's branch
    from a token. The replica builds the prompt's ids, then appends each part in order: token ids as they are,
    text tokenized without special tokens. All of it counts as prompt; an identical prefix of ids shares the
    parent's KV blocks through the prefix cache."""

    parts: list[Annotated[list[TokenId], Field(max_length=32768)] | Annotated[str, Field(max_length=8000)]] = Field(
        default_factory=list, max_length=64)


class GenerationRequest(_Model):
    v: int = PROTOCOL_VERSION
    request_id: str = Field(default_factory=new_request_id, pattern=REQUEST_ID_PATTERN)
    prompt: str | list[TokenId] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    params: SamplingOptions = Field(default_factory=SamplingOptions)
    model: str | None = None
    client_id: str = Field("", max_length=128)
    created_at: float = Field(default_factory=time.time)
    deadline: float | None = None  # unix time; past it the request is dropped with an error event
    continuation: Continuation | None = None  # generate after the prompt plus these tokens (a branch)
    # with messages: the tools (OpenAI's {"type": "function", "function": {name, description, parameters}}) the
    # chat template shows the model; calls to them are the API's to shape (shared/openai_tools.py)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)

    @model_validator(mode="after")
    def _one_input(self) -> GenerationRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be given")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages (a chat)")
        return self


# speculative decoding, per generated token: a draft token the target kept, one the target drew after a rejection,
# the extra token drawn after all k drafts were kept, or one decoded without a proposal (e.g. no n-gram match)
SpecMark = str  # "accepted" | "resampled" | "bonus" | "target" (a str, so a new engine mark cannot break a stream)


class TokenLogprob(_Model):
    token_id: int
    token: str
    logprob: float | None  # None where the engine gave -inf
    top: list[tuple[int, str, float | None]] = Field(default_factory=list)
    # nats, of the raw (unprocessed) next-token distribution this token was drawn from; None where the engine
    # does not report it (prompt scores, older replicas)
    entropy: float | None = None
    # structured outputs: the probability (of the raw distribution) on the tokens the grammar forbade at this
    # position; None without a grammar
    masked: float | None = None


class DraftCheck(_Model):
    """Speculative decoding: how the target judged one drafted token; rides with the token it produced (the
    accepted draft token, or the target's own token in place of a rejected one). The engine verifies with a
    Gumbel-max coupling (engine/spec_decode.py): `accepted` is what it did; `accept_prob` and `residual_top` are
    what standard rejection sampling (Leviathan et al. 2023) would do with the same p and q."""

    position: int = Field(ge=0)  # in its draft: 0 is the first token proposed after the last verified one
    draft_token_id: int
    draft_token: str
    p_draft: float | None  # q(x), the proposer's probability; None for a proposer without one (n-gram: q = 1)
    p_target: float  # p(x), the target's probability after the request's processors
    accept_prob: float  # min(1, p(x) / q(x)); a greedy target keeps x iff it is the argmax (1 or 0)
    accepted: bool
    # a rejection: the token the target drew instead (its coupled draw from p, or its argmax when greedy), and the
    # head of the residual distribution max(0, p - q) renormalised, best first (token id, text, probability)
    residual_token_id: int | None = None
    residual_token: str | None = None
    residual_top: list[tuple[int, str, float]] = Field(default_factory=list)


class SamplerStage(_Model):
    """The sampler pipeline (params.sampler_stages), one stage of one generated token: the distribution after that
    processor, computed by the engine from the logits it sampled from. Stages in the sampler's order, each only
    where it changed the distribution: raw, grammar (the structured-outputs mask), penalties (logit bias,
    repetition, presence / frequency, the min_tokens EOS ban), temperature, top_k, top_p, min_p."""

    name: str
    top: list[tuple[int, str, float]]  # the N most likely (id, text, probability), best first
    kept: int  # tokens still possible (finite logit)
    removed: float  # probability of the previous stage on the tokens this stage removed
    other: float  # probability on the kept tokens outside `top`
    chosen_rank: int  # of the generated token: tokens more likely than it (0: the most likely)
    chosen_prob: float


class BeamEvent(_Model):
    """Beam search, one change of the beam tree (TokenEvent.beam). Nodes are the hypotheses of each search step:
    `node` is new on a fork and a finish, ids are unique per request and attempt, the root (the prompt) is 0."""

    kind: Literal["fork", "prune", "finish"]  # fork: a live beam grew by `token_id` from `parent`; prune: `node`
    # fell out of the search (no child survived, or a finished hypothesis lost its place); finish: `node` ended
    step: int = Field(ge=0)  # search step; a fork or finish at step s adds the (s+1)-th generated token
    node: int = Field(ge=0)
    parent: int | None = None
    token_id: int | None = None
    token: str | None = None
    logprob: float | None = None  # of the token under the parent's raw distribution
    score: float | None = None  # fork: summed processed log-probs; finish: the length-penalised final score
    rank: int | None = None  # fork: place among the live beams (0 best); finish: among the finished
    blocks: list[int] | None = None  # fork: the beam's KV block table after the step (shared blocks appear twice)


class PromptScores(_Model):
    """The prompt as the engine scored it (params.prompt_logprobs): its text, and one entry per prompt token,
    the first with logprob None (nothing precedes it)."""

    text: str
    logprobs: list[TokenLogprob]


class _Event(_Model):
    v: int = PROTOCOL_VERSION
    request_id: str
    seq: int = Field(ge=0)  # per request and attempt: 0, 1, 2, ... so a client can see a gap
    attempt: int = Field(1, ge=1)  # > 1 when a replica re-runs a request whose replica died


class TokenEvent(_Event):
    type: Literal["token"] = "token"
    index: int = 0  # which of the n outputs
    text_delta: str
    token_ids: list[int]
    reset: bool = False  # the output was rewritten (beam search): text_delta/token_ids are the whole output
    logprobs: list[TokenLogprob] | None = None
    spec: list[SpecMark] | None = None  # speculative decoding: one mark per token in token_ids
    # speculative decoding: per token in token_ids, the draft check that produced it (None: bonus / target token)
    drafts: list[DraftCheck | None] | None = None
    # params.prompt_logprobs: on the first event that has them (and the DoneEvent), see PromptScores
    prompt: PromptScores | None = None
    # beam search: the tree's changes since the last event (index 0 carries them; the ids are in `beam.node`)
    beam: list[BeamEvent] | None = None
    # params.sampler_stages: per token in token_ids, its sampler pipeline, raw first (on token events only)
    stages: list[list[SamplerStage]] | None = None


class Completion(_Model):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprob] | None = None
    score: float | None = None  # beam search: the length-penalised beam score
    spec: list[SpecMark] | None = None  # speculative decoding marks, one per token
    drafts: list[DraftCheck | None] | None = None  # speculative decoding: per token, as in TokenEvent.drafts


class Metrics(_Model):
    replica: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float | None = None  # created -> picked up by a replica
    ttft_s: float | None = None  # created -> first token
    tpot_s: float | None = None  # mean time per output token after the first
    e2e_s: float | None = None  # created -> done
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache held (computed again: 0)
    # speculative counters: proposed, accepted, steps, ... and per draft position proposed/accepted lists
    spec: dict[str, float | int | str | list[int] | None] | None = None
    # prefill/decode disaggregation: the prefill replica, blocks and bytes handed over, transfer_ms (sent -> taken),
    # imported_tokens (prompt tokens written into this replica's cache); None when one replica did it all
    handover: dict[str, float | int | str] | None = None


class DoneEvent(_Event):
    type: Literal["done"] = "done"
    finish_reason: str | None  # of output 0: "stop", "length", "cancelled", ...
    text: str  # full text of output 0
    outputs: list[Completion]
    metrics: Metrics = Field(default_factory=Metrics)
    prompt: PromptScores | None = None  # params.prompt_logprobs


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str


Event = Annotated[TokenEvent | DoneEvent | ErrorEvent, Field(discriminator="type")]
TerminalEvent = DoneEvent | ErrorEvent
_event_adapter: TypeAdapter[Event] = TypeAdapter(Event)


def encode(model: BaseModel) -> str:
    return model.model_dump_json()


def decode_event(data: str | bytes) -> TokenEvent | DoneEvent | ErrorEvent:
    """Parse one event; raises pydantic.ValidationError on anything malformed."""
    return _event_adapter.validate_json(data)


def decode_request(data: str | bytes) -> GenerationRequest:
    return GenerationRequest.model_validate_json(data)
