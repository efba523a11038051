"""What one column knows about its request: streamed tokens (with logprobs and speculative marks), status, metrics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.protocol import (
    Completion,
    DoneEvent,
    DraftCheck,
    ErrorEvent,
    GenerationRequest,
    SamplerStage,
    TokenEvent,
    TokenLogprob,
)
from web.beam_tree import BeamTree

FINAL = ("done", "error", "cancelled", "invalid", "off")


@dataclass
class Token:
    text: str
    token_id: int | None = None
    logprob: float | None = None
    top: list[tuple[int, str, float | None]] = field(default_factory=list)
    mark: str | None = None  # speculative: accepted | resampled | bonus | target
    entropy: float | None = None  # nats, of the raw distribution it was drawn from (TokenLogprob.entropy)
    masked: float | None = None  # structured outputs: the probability the grammar removed here (TokenLogprob.masked)
    draft: DraftCheck | None = None  # speculative: how the target judged the draft this token answers
    stages: list[SamplerStage] | None = None  # params.sampler_stages: its sampler pipeline (TokenEvent.stages)


@dataclass
class Output:
    index: int
    tokens: list[Token] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    score: float | None = None  # beam search: length-penalised score


def _tokens(ids: list[int], text: str, logprobs: list[TokenLogprob] | None, marks: list | None,
            drafts: list[DraftCheck | None] | None = None) -> list[Token]:
    marks = list(marks or [])
    drafts = list(drafts) if drafts is not None and len(drafts) == len(ids) else [None] * len(ids)
    if logprobs and len(logprobs) == len(ids):
        return [Token(lp.token, lp.token_id, lp.logprob, list(lp.top), marks[i] if i < len(marks) else None,
                      getattr(lp, "entropy", None), getattr(lp, "masked", None), draft=drafts[i])
                for i, lp in enumerate(logprobs)]
    if len(ids) == 1:
        return [Token(text, ids[0], mark=marks[0] if marks else None, draft=drafts[0])]
    return [Token(text, mark=marks[0] if marks else None)] if text else []


@dataclass
class Column:
    mode: str
    status: str = "idle"  # idle | waiting | queued | running | done | error | cancelled | invalid | off
    request: GenerationRequest | None = None
    error: str | None = None
    error_code: str | None = None
    queue_position: int | None = None
    entry_id: str | None = None  # the request's Redis stream entry
    stream: str | None = None  # the stream it was queued on (the replica it was routed to, or the shared one)
    outputs: dict[int, Output] = field(default_factory=dict)
    submitted_at: float | None = None  # unix time (the request's created_at)
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: DoneEvent | None = None
    attempt: int = 0  # the run whose tokens are shown; a re-run (its replica died) starts the text again
    restarts: int = 0
    beam_tree: BeamTree = field(default_factory=BeamTree)  # beam search: the tree the engine streamed (TokenEvent.beam)
    version: int = 0  # bumped on every change, so unchanged columns are not re-sent

    @property
    def finished(self) -> bool:
        return self.status in FINAL

    @property
    def request_id(self) -> str | None:
        return self.request.request_id if self.request is not None else None

    def touch(self) -> None:
        self.version += 1

    def fail(self, message: str, code: str = "invalid_request", status: str = "error") -> None:
        self.status, self.error, self.error_code = status, message, code
        self.touch()

    # ---- events
    def feed(self, ev: TokenEvent | DoneEvent | ErrorEvent) -> None:
        if isinstance(ev, TokenEvent):
            self._on_token(ev)
        elif isinstance(ev, DoneEvent):
            self._on_done(ev)
        else:
            self.fail(ev.message, ev.code)

    def _on_token(self, ev: TokenEvent) -> None:
        now = time.time()
        self.status, self.queue_position = "running", None
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        if ev.attempt != self.attempt:
            if self.attempt:  # another replica took over: show its run from the start, not a mix of two
                self.outputs, self.restarts, self.beam_tree = {}, self.restarts + 1, BeamTree()
            self.attempt = ev.attempt
        if ev.beam:
            self.beam_tree.feed(ev.beam)
        out = self.outputs.setdefault(ev.index, Output(ev.index))
        new = _tokens(ev.token_ids, ev.text_delta, ev.logprobs, ev.spec, getattr(ev, "drafts", None))
        if ev.stages is not None and len(ev.stages) == len(new):
            for token, stages in zip(new, ev.stages):
                token.stages = stages
        if ev.reset:
            out.tokens, out.token_ids, out.text = new, list(ev.token_ids), ev.text_delta
        else:
            out.tokens += new
            out.token_ids += ev.token_ids
            out.text += ev.text_delta
        self.touch()

    def _on_done(self, ev: DoneEvent) -> None:
        self.done = ev
        self.status = "cancelled" if ev.finish_reason in ("cancelled", "abort") else "done"
        for c in ev.outputs:
            self._final_output(c)
        self.touch()

    def _final_output(self, c: Completion) -> None:
        old = self.outputs.get(c.index, Output(c.index))
        out = Output(c.index, token_ids=list(c.token_ids), text=c.text, finish_reason=c.finish_reason,
                     cumulative_logprob=c.cumulative_logprob, score=getattr(c, "score", None))
        marks = getattr(c, "spec", None) or [t.mark for t in old.tokens]
        drafts = getattr(c, "drafts", None) or [t.draft for t in old.tokens]
        if c.logprobs and len(c.logprobs) == len(c.token_ids):
            out.tokens = _tokens(c.token_ids, c.text, c.logprobs, marks if len(marks) == len(c.token_ids) else None,
                                 drafts)
            if len(old.tokens) == len(out.tokens):  # the pipelines streamed only (DoneEvent carries none)
                for token, streamed in zip(out.tokens, old.tokens):
                    token.stages = streamed.stages
        else:  # no logprobs: keep what streamed (it adds up to the final text unless a stop string cut it)
            out.tokens = old.tokens if "".join(t.text for t in old.tokens) == c.text else [Token(c.text)]
        self.outputs[c.index] = out

    # ---- metrics (the replica's own numbers once done; live estimates before)
    @property
    def num_tokens(self) -> int:
        if self.done is not None:
            return self.done.metrics.completion_tokens
        return max((len(o.token_ids) for o in self.outputs.values()), default=0)

    @property
    def ttft(self) -> float | None:
        if self.done is not None and self.done.metrics.ttft_s is not None:
            return self.done.metrics.ttft_s
        if self.first_token_at is not None and self.submitted_at is not None:
            return self.first_token_at - self.submitted_at
        return None

    @property
    def tpot(self) -> float | None:
        if self.done is not None:
            return self.done.metrics.tpot_s
        n = self.num_tokens
        if n > 1 and self.first_token_at is not None and self.last_token_at is not None:  # (an edited run file)
            return (self.last_token_at - self.first_token_at) / (n - 1)
        return None

    @property
    def elapsed(self) -> float | None:
        """Request created -> last token (done: created -> finished)."""
        if self.done is not None and self.done.metrics.e2e_s is not None:
            return self.done.metrics.e2e_s
        if self.submitted_at is None:
            return None
        end = self.last_token_at if self.finished and self.last_token_at else time.time()
        return end - self.submitted_at

    @property
    def tokens_per_s(self) -> float | None:
        n, t = self.num_tokens, self.elapsed
        return n / t if n and t else None

    def spec_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        out = self.outputs.get(0)
        for t in out.tokens if out else []:
            if t.mark:
                counts[t.mark] = counts.get(t.mark, 0) + 1
        return counts

    def acceptance_rate(self, k: int) -> tuple[float, bool] | None:
        """(accepted / proposed, exact?): the replica's counters when it sends them, else from the token marks."""
        spec = getattr(self.done.metrics, "spec", None) if self.done is not None else None
        if isinstance(spec, dict) and spec.get("proposed"):
            return spec.get("accepted", 0) / spec["proposed"], True
        c = self.spec_counts()
        rounds = c.get("resampled", 0) + c.get("bonus", 0)  # each verification ends with one of these
        if not rounds:
            return None
        return min(1.0, c.get("accepted", 0) / (rounds * k)), False

    def by_position(self, k: int) -> tuple[list[int], list[int], bool] | None:
        """Per draft position (0 first): (proposed, accepted, exact?). The replica's counters when it sends them;
        while streaming, counted from the tokens' draft checks: the accepted exactly, the proposed as one per
        verification round at every position below k (a round drafts k, fewer near max_tokens or with an adaptive k:
        an estimate until the replica's counters come)."""
        spec = getattr(self.done.metrics, "spec", None) if self.done is not None else None
        if isinstance(spec, dict) and isinstance(spec.get("proposed_by_position"), list):
            return list(spec["proposed_by_position"]), list(spec.get("accepted_by_position") or []), True
        out = self.outputs.get(0)
        checks = [t.draft for t in out.tokens if t.draft is not None] if out else []
        if not checks:
            return None
        width = max(k, 1 + max(c.position for c in checks))
        rounds = sum(c.position == 0 for c in checks)  # every round with drafts judges its first one
        return [rounds] * width, [sum(c.accepted and c.position == i for c in checks) for i in range(width)], False

    def tokens_per_step(self) -> float | None:
        """Tokens per target forward: every forward ends with exactly one resampled, bonus or target token."""
        c = self.spec_counts()
        forwards = c.get("resampled", 0) + c.get("bonus", 0) + c.get("target", 0)
        return sum(c.values()) / forwards if forwards else None

    def summary(self) -> dict:
        """The column as plain data (the run's JSON output, which API clients and tests read)."""
        return {
            "mode": self.mode, "status": self.status, "request_id": self.request_id,
            "error": self.error, "error_code": self.error_code,
            "finish_reason": self.done.finish_reason if self.done else None,
            "outputs": [{"index": o.index, "text": o.text, "token_ids": o.token_ids,
                         "finish_reason": o.finish_reason, "cumulative_logprob": o.cumulative_logprob,
                         "score": o.score, "spec": [t.mark for t in o.tokens] if self.mode == "speculative" else None}
                        for o in sorted(self.outputs.values(), key=lambda o: o.index)],
            "metrics": {"ttft_s": self.ttft, "tpot_s": self.tpot, "tokens": self.num_tokens,
                        "tokens_per_s": self.tokens_per_s, "e2e_s": self.elapsed,
                        "queue_s": self.done.metrics.queue_s if self.done else None,
                        "replica": self.done.metrics.replica if self.done else None},
        }
