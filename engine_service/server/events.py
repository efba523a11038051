"""Engine outputs -> protocol events. No Redis, no engine calls: the tokenizer only names tokens.

A stream carries, per output index, the text and token ids published so far (`Job.sent`). Each new output becomes
a TokenEvent with what was added, or a `reset` event with the whole text when an output is no longer an
extension of what was sent (beam search rewrites its beams). The final DoneEvent carries every output whole.
"""
from __future__ import annotations

import time

from engine_service.server.jobs import Job
from shared.protocol import Completion, DoneEvent, ErrorEvent, Metrics, TokenEvent, TokenLogprob


def token_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]]) -> list[TokenLogprob]:
    def lp(x: float) -> float | None:
        return x if x > float("-inf") else None

    out = []
    for tid, top in zip(token_ids, entries):
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        out.append(TokenLogprob(token_id=tid, token=tokenizer.decode([tid]), logprob=lp(top.get(tid, float("-inf"))),
                                top=[(t, tokenizer.decode([t]), lp(v)) for t, v in ranked]))
    return out


def token_events(job: Job, out, tokenizer) -> list[TokenEvent]:
    """What `out` (a RequestOutput) adds to each of the job's streams; records it as sent."""
    events = []
    for comp in out.outputs:
        sent_text, sent_ids = job.sent.get(comp.index, ("", []))
        if comp.token_ids == sent_ids and comp.text == sent_text:
            continue
        reset = not (comp.text.startswith(sent_text) and comp.token_ids[:len(sent_ids)] == sent_ids)
        start = 0 if reset else len(sent_ids)
        new_ids = comp.token_ids[start:]
        logprobs = None
        if comp.logprobs is not None:
            logprobs = token_logprobs(tokenizer, new_ids, comp.logprobs[start:])
        marks = comp.spec_marks
        events.append(TokenEvent(request_id=job.rid, seq=job.next_seq(), attempt=job.attempt, index=comp.index,
                                 text_delta=comp.text if reset else comp.text[len(sent_text):], token_ids=new_ids,
                                 reset=reset, logprobs=logprobs, spec=marks[start:] if marks is not None else None))
        job.sent[comp.index] = (comp.text, list(comp.token_ids))
    return events


def done_event(job: Job, reason: str | None, outputs, tokenizer, replica: str) -> DoneEvent:
    """The terminal event. `outputs` are the engine's CompletionOutputs, or None for a cancelled job, which ends
    with what was streamed so far."""
    if not outputs:
        sent = sorted(job.sent.items()) or [(0, ("", []))]
        completions = [Completion(index=i, text=text, token_ids=ids, finish_reason=reason)
                       for i, (text, ids) in sent]
    else:
        completions = [Completion(index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason,
                                  cumulative_logprob=c.cumulative_logprob,
                                  logprobs=(token_logprobs(tokenizer, c.token_ids, c.logprobs)
                                            if c.logprobs is not None else None),
                                  score=c.score, spec=c.spec_marks)
                       for c in outputs]
    now = time.time()
    created = job.request.created_at
    n_out = max(len(c.token_ids) for c in completions)
    tpot = None
    if job.first_token_at is not None and n_out > 1:
        tpot = (job.last_token_at - job.first_token_at) / (n_out - 1)
    metrics = Metrics(replica=replica, prompt_tokens=job.prompt_tokens, completion_tokens=n_out,
                      queue_s=job.picked_at - created, e2e_s=now - created, tpot_s=tpot, spec=job.spec,
                      ttft_s=None if job.first_token_at is None else job.first_token_at - created)
    return DoneEvent(request_id=job.rid, seq=job.next_seq(), attempt=job.attempt, finish_reason=reason,
                     text=completions[0].text, outputs=completions, metrics=metrics)


def error_event(job: Job, code: str, message: str) -> ErrorEvent:
    return ErrorEvent(request_id=job.rid, seq=job.next_seq(), attempt=job.attempt, code=code, message=message)
