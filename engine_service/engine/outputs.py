from dataclasses import asdict, dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]  # generated ids only
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: {token_id: logprob} (top-N + chosen)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    score: float | None = None  # beam search: the length-penalised beam score
    # speculative decoding, one mark per generated token: "accepted" (a draft token the target kept),
    # "resampled" (drawn by the target after a rejection), "bonus" (drawn after all k were accepted),
    # "target" (decoded without a proposal: the first token, or no n-gram match)
    spec_marks: list[str] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    queue_time: float | None = None  # arrival -> first scheduled
    ttft: float | None = None  # arrival -> first token
    tpot: float | None = None  # mean time per output token after the first
    e2e: float | None = None  # arrival -> finished
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    spec: dict | None = None  # speculative decoding counters

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "arrival_time"}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default=None)
