"""Engine outputs -> protocol events. No Redis, no engine calls: the tokenizer only names tokens.

A stream carries, per output index, the text and token ids published so far (`Job.sent`). Each new output becomes
a TokenEvent with what was added, or a `reset` event with the whole text when an output is no longer an
extension of what was sent (beam search rewrites its beams). The final DoneEvent carries every output whole.
Prompt log-probs (params.prompt_logprobs) ride on the first TokenEvent after the prefill and on the DoneEvent.
"""
from __future__ import annotations

import math
import time
import weakref

from engine_service.server.jobs import Job
from shared.protocol import (
    BeamEvent,
    Completion,
    DoneEvent,
    DraftCheck,
    ErrorEvent,
    Metrics,
    PromptScores,
    SamplerStage,
    TokenEvent,
    TokenLogprob,
)

_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its text alone}


def token_text(tokenizer, token_id: int) -> str:
    """tokenizer.decode([token_id]), remembered per tokenizer: a four-mode step names ~30 tokens (each token and its
    top alternatives), and one HF decode call costs ~10-20 us on the 2-core target."""
    try:
        texts = _TEXTS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: decode every time
        return tokenizer.decode([token_id])
    text = texts.get(token_id)
    if text is None:
        text = texts[token_id] = tokenizer.decode([token_id])
    return text


def _finite(values: list[float | None] | None, i: int) -> float | None:
    x = values[i] if values is not None and i < len(values) else None
    return x if x is not None and math.isfinite(x) else None


def token_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]],
                   entropies: list[float] | None = None, masked: list[float | None] | None = None,
                   memo: dict | None = None) -> list[TokenLogprob]:
    """One TokenLogprob per token. `memo` (a job's) keeps each record by its engine entry: a beam's reset event
    re-sends its whole output every step, and the entries of the tokens it keeps are the same dict objects
    (beam.py shares them between a beam and its forks), so their records are built once (~0.7 ms a four-mode
    step on the 2-core target otherwise). An entry is held with its record, so its id() cannot be reused."""
    def lp(x: float) -> float | None:
        return x if x > float("-inf") else None

    out = []
    for i, (tid, top) in enumerate(zip(token_ids, entries)):
        ent, mk = _finite(entropies, i), _finite(masked, i)
        hit = memo.get(id(top)) if memo is not None else None
        if hit is not None and hit[0] is top and (hit[1].token_id, hit[1].entropy, hit[1].masked) == (tid, ent, mk):
            out.append(hit[1])
            continue
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        rec = TokenLogprob(token_id=tid, token=token_text(tokenizer, tid), logprob=lp(top.get(tid, float("-inf"))),
                           top=[(t, token_text(tokenizer, t), lp(v)) for t, v in ranked], entropy=ent, masked=mk)
        if memo is not None:
            memo[id(top)] = (top, rec)
        out.append(rec)
    return out


def draft_checks(tokenizer, drafts: list[dict | None] | None) -> list[DraftCheck | None] | None:
    """The engine's per-token draft checks (CompletionOutput.drafts) with the tokens' text."""
    if drafts is None:
        return None
    out: list[DraftCheck | None] = []
    for d in drafts:
        if d is None:
            out.append(None)
            continue
        d = dict(d)
        d["draft_token"] = token_text(tokenizer, d["draft_token_id"])
        if d.get("residual_token_id") is not None:
            d["residual_token"] = token_text(tokenizer, d["residual_token_id"])
        d["residual_top"] = [(t, token_text(tokenizer, t), p) for t, p in d.get("residual_top") or []]
        out.append(DraftCheck(**d))
    return out


def sampler_stages(tokenizer, stages: list[list[dict]] | None) -> list[list[SamplerStage]] | None:
    """The engine's per-token sampler pipelines (CompletionOutput.stages) with the tokens' text."""
    if stages is None:
        return None
    return [[SamplerStage(**{**s, "top": [(t, token_text(tokenizer, t), p) for t, p in s["top"]]}) for s in token]
            for token in stages]


def beam_events(tokenizer, events: list[dict] | None) -> list[BeamEvent] | None:
    """The engine's beam-tree changes (RequestOutput.beam_events) with the tokens' text."""
    if not events:
        return None
    return [BeamEvent(**e, token=token_text(tokenizer, e["token_id"]) if e.get("token_id") is not None else None)
            for e in events]


def prompt_scores(tokenizer, prompt_ids: list[int], entries: list[dict[int, float] | None]) -> PromptScores:
    """The engine's RequestOutput.prompt_logprobs (None, then one dict per prompt token) as protocol records."""
    first = TokenLogprob(token_id=prompt_ids[0], token=token_text(tokenizer, prompt_ids[0]), logprob=None)
    return PromptScores(text=tokenizer.decode(prompt_ids),
                        logprobs=[first, *token_logprobs(tokenizer, prompt_ids[1:], entries[1:])])


def token_events(job: Job, out, tokenizer) -> list[TokenEvent]:
    """What `out` (a RequestOutput) adds to each of the job's streams; records it as sent, and what the DoneEvent
    will report of the prompt (its scores, the prefix-cache hits)."""
    if out.metrics is not None:
        job.cached_prompt_tokens = out.metrics.cached_prompt_tokens
    new_prompt = None
    if out.prompt_logprobs is not None and job.prompt is None:
        job.prompt = new_prompt = prompt_scores(tokenizer, out.prompt_token_ids, out.prompt_logprobs)
    events = []
    tree = beam_events(tokenizer, getattr(out, "beam_events", None))
    for comp in out.outputs:
        sent_text, sent_ids = job.sent.get(comp.index, ("", []))
        if comp.token_ids == sent_ids and comp.text == sent_text and not (tree and comp.index == 0):
            continue
        reset = not (comp.text.startswith(sent_text) and comp.token_ids[:len(sent_ids)] == sent_ids)
        start = 0 if reset else len(sent_ids)
        new_ids = comp.token_ids[start:]
        logprobs = None
        if comp.logprobs is not None:
            ents, masked = getattr(comp, "entropies", None), getattr(comp, "masked", None)
            logprobs = token_logprobs(tokenizer, new_ids, comp.logprobs[start:], ents[start:] if ents else None,
                                      masked[start:] if masked else None, job.logprob_memo)
        marks, drafts, stages = comp.spec_marks, getattr(comp, "drafts", None), getattr(comp, "stages", None)
        events.append(TokenEvent(request_id=job.rid, seq=job.next_seq(), attempt=job.attempt, index=comp.index,
                                 text_delta=comp.text if reset else comp.text[len(sent_text):], token_ids=new_ids,
                                 reset=reset, logprobs=logprobs, spec=marks[start:] if marks is not None else None,
                                 drafts=draft_checks(tokenizer, drafts[start:] if drafts is not None else None),
                                 prompt=None if events else new_prompt, beam=tree if comp.index == 0 else None,
                                 stages=sampler_stages(tokenizer, stages[start:] if stages is not None else None)))
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
                                  logprobs=(token_logprobs(tokenizer, c.token_ids, c.logprobs,
                                                           getattr(c, "entropies", None), getattr(c, "masked", None),
                                                           job.logprob_memo)
                                            if c.logprobs is not None else None),
                                  score=c.score, spec=c.spec_marks,
                                  drafts=draft_checks(tokenizer, getattr(c, "drafts", None)))
                       for c in outputs]
    now = time.time()
    created = job.request.created_at
    n_out = max(len(c.token_ids) for c in completions)
    tpot = None
    if job.first_token_at is not None and n_out > 1:
        tpot = (job.last_token_at - job.first_token_at) / (n_out - 1)
    metrics = Metrics(replica=replica, prompt_tokens=job.prompt_tokens, completion_tokens=n_out,
                      cached_prompt_tokens=job.cached_prompt_tokens,
                      queue_s=job.picked_at - created, e2e_s=now - created, tpot_s=tpot, spec=job.spec,
                      handover=job.handover,
                      ttft_s=None if job.first_token_at is None else job.first_token_at - created)
    return DoneEvent(request_id=job.rid, seq=job.next_seq(), attempt=job.attempt, finish_reason=reason,
                     text=completions[0].text, outputs=completions, metrics=metrics, prompt=job.prompt)


def error_event(job: Job, code: str, message: str) -> ErrorEvent:
    return ErrorEvent(request_id=job.rid, seq=job.next_seq(), attempt=job.attempt, code=code, message=message)
