"""What the engine reports per request and step, and how it is built from a Request."""
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_service.engine.detokenizer import Detokenizer
    from engine_service.engine.sequence import Request


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]  # generated ids only
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: {token_id: logprob} (top-N + chosen)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (RequestOutput.error says why)
    score: float | None = None  # beam search: the length-penalised beam score
    # speculative decoding, one mark per generated token: "accepted" (a draft token the target kept),
    # "resampled" (drawn by the target after a rejection), "bonus" (drawn after all k were accepted),
    # "target" (decoded without a proposal: the first token, or no n-gram match)
    spec_marks: list[str] | None = None
    # with logprobs: the entropy (nats) of the raw distribution each token was drawn from (for a beam's token:
    # of its parent beam's next-token distribution)
    entropies: list[float] | None = None
    # with logprobs and a grammar: per token, the raw probability on the tokens the grammar forbade there
    masked: list[float | None] | None = None
    # speculative decoding, per generated token: the draft check that produced it (None: a bonus/target token),
    # a dict with DraftCheck's fields (shared/protocol.py) but token ids only: position, draft_token_id, p_draft,
    # p_target, accept_prob, accepted, residual_token_id, residual_top [(id, probability)]
    drafts: list[dict | None] | None = None
    # params.sampler_stages: per generated token, its sampler pipeline, StageRecord dicts raw first (pipeline.py)
    stages: list[list[dict]] | None = None


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
    # set when this request made the engine raise: it finished alone (finish_reason "error"), the batch went on
    error: str | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {id: log-prob} per prompt token
    # (top-N plus the token); set once the prefill has scored the whole prompt
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # beam search: the tree's changes since the last output (beam.py), dicts with BeamEvent's fields, ids only
    beam_events: list[dict] | None = None


def request_output(req: "Request", detok: "Detokenizer", finished: bool, error: str | None) -> RequestOutput:
    """Everything generated so far; a running sequence shows only the text it can no longer take back."""
    metrics = request_metrics(req)
    if req.beam is not None and error is None:
        outs = req.beam.outputs(req, lambda ids: detok.decode(ids, req.params))
        metrics.generated_tokens = max((len(o.token_ids) for o in outs), default=0)
    else:
        with_logprobs = req.params.logprobs is not None
        outs = [CompletionOutput(s.index, detok.visible_text(s), list(s.output_token_ids), s.cumulative_logprob,
                                 list(s.logprobs) if with_logprobs else None, s.finish_reason,
                                 spec_marks=list(s.spec_marks) if s.spec_marks is not None else None,
                                 entropies=list(s.entropies) if with_logprobs and len(s.entropies) == len(
                                     s.logprobs) else None,
                                 masked=list(s.masked) if with_logprobs and s.grammar is not None and len(
                                     s.masked) == len(s.logprobs) else None,
                                 drafts=list(s.draft_checks) if s.draft_checks is not None else None,
                                 stages=list(s.stages) if req.params.sampler_stages else None)
                for s in sorted(req.seqs, key=lambda s: s.index)]
    if req.spec is not None:
        metrics.spec = req.spec.to_dict()
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is not None and len(prompt_logprobs) < len(req.prompt_token_ids):
        prompt_logprobs = None  # still prefilling
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, metrics, error,
                         list(prompt_logprobs) if prompt_logprobs is not None else None,
                         req.beam.drain() if req.beam is not None else None)


def request_metrics(req: "Request") -> RequestMetrics:
    generated = max((s.num_output_tokens for s in req.seqs), default=0)
    m = RequestMetrics(req.arrival_time, prompt_tokens=len(req.prompt_token_ids),
                       cached_prompt_tokens=req.num_cached_tokens, generated_tokens=generated)
    if req.first_scheduled_time is not None:
        m.queue_time = req.first_scheduled_time - req.arrival_time
    if req.first_token_time is not None:
        m.ttft = req.first_token_time - req.arrival_time
        if generated > 1:
            m.tpot = (req.last_token_time - req.first_token_time) / (generated - 1)
    if req.finished_time is not None:
        m.e2e = req.finished_time - req.arrival_time
    return m
