"""The engine thread: applies commands (add, cancel, drop), steps the engine, turns its outputs into events.

It is the only thread that touches the engine. An exception raised for one request ends that request only;
the engine isolates failures inside a step (RequestOutput.error), and a step that still raises fails what was
running and keeps the replica serving.
"""
from __future__ import annotations

import logging
import queue
import time

from engine_service.engine.kv_transfer import export_prompt_blocks, import_prompt_blocks
from engine_service.engine.sampling_params import SamplingParams
from engine_service.server.events import done_event, error_event, token_events
from engine_service.server.jobs import (
    Add,
    AppendSteps,
    Cancel,
    Command,
    Drop,
    Job,
    KVEvents,
    KVSync,
    Publish,
    StoreSnapshot,
)
from engine_service.server.kv_snapshot import kv_snapshot
from engine_service.server.state import ReplicaState
from shared.protocol import DoneEvent, ErrorEvent, encode
from shared.routing import chat_prompt, routing_name

log = logging.getLogger("decodelab.replica")


class EngineLoop:
    def __init__(self, state: ReplicaState):
        self.s = state
        self.engine = state.engine
        self._stats_at = 0.0
        self._kv_last: dict | None = None
        self._kv_sent_at = 0.0
        self._steps_sent = self.engine.num_steps  # a shared engine (tests) may have stepped before this replica
        self._steps_at = 0.0  # when step records were last handed to the publisher
        self.engine.block_manager.record_events()  # drained after every step into KV events (routers read them)
        state.kv_resync.set()  # the first publication is the whole cache (a shared engine may hold blocks already)

    def run(self) -> None:
        s = self.s
        while not s.stop.is_set():
            for command in self._commands():
                self._apply(command)
            if s.kv_resync.is_set():
                s.kv_resync.clear()
                self.engine.block_manager.take_events()  # the whole set below includes them
                s.outbox.put(KVSync([routing_name(h) for h in self.engine.block_manager.cached]))
            self._check_deadlines()
            if self.engine.has_unfinished():
                self._step()
            if time.monotonic() - self._stats_at > s.cfg.stats_interval_s:
                s.stats, self._stats_at = self.engine.stats(), time.monotonic()
                self._snapshot_kv()

    def _commands(self) -> list[Command]:
        """Every queued command; waits a little for one when the engine is idle."""
        out = []
        try:
            item = (self.s.commands.get_nowait() if self.engine.has_unfinished()
                    else self.s.commands.get(timeout=0.05))
            while item is not None:
                out.append(item)
                item = self.s.commands.get_nowait()
        except queue.Empty:
            pass
        return out

    def _step(self) -> None:
        s = self.s
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug the engine could not pin on one request: fail what ran, keep serving
            log.exception("engine step failed")
            self._fail_all("engine_error", f"engine step failed: {type(e).__name__}: {e}")
            return
        # the step records, batched (cfg.steps_interval_s; `_end` sends what is left before a result)
        if time.monotonic() - self._steps_at >= s.cfg.steps_interval_s or not self.engine.has_unfinished():
            self._queue_steps()
        # before this step's tokens: a client that saw a token (the playground's first column) finds its prefix
        # published when it routes the next request
        if events := self.engine.block_manager.take_events():
            s.outbox.put(KVEvents([(ev.stored, routing_name(ev.block_hash)) for ev in events]))
        now = time.time()
        if outputs:
            s.max_batch = max(s.max_batch, len(outputs))
            s.metrics.batch.observe(len(outputs))
        for out in outputs:
            if (job := s.jobs.get(out.request_id)) is None:
                continue
            try:
                self._on_output(job, out, now)
            except Exception as e:  # fail this request, keep the others
                log.exception("output of %s", job.rid)
                self.engine.abort(job.rid)
                self._end(job, error_event(job, "engine_error", f"{type(e).__name__}: {e}"))

    def _snapshot_kv(self) -> None:
        """Queue the KV picture for Redis when it changed (else every 2 s, to keep the key alive)."""
        s = self.s
        snap = kv_snapshot(self.engine, s.cfg.name, s.cfg.model_name, s.stats)
        body = snap.model_dump(exclude={"at"})
        if body != self._kv_last or time.monotonic() - self._kv_sent_at > 2.0:
            self._kv_last, self._kv_sent_at = body, time.monotonic()
            s.outbox.put(StoreSnapshot(s.keys.kv(s.cfg.name), encode(snap)))

    def _end(self, job: Job, terminal: DoneEvent | ErrorEvent) -> None:
        """The job's result (ReplicaState.end), after the step records not yet sent: a client holding a result, of
        any kind, finds every step of that request on the stream."""
        self._queue_steps()
        self.s.end(job, terminal)

    def _queue_steps(self) -> None:
        """Hand the engine's new step records (engine.step_log) to the publisher, for the playground's roofline."""
        self._steps_at = time.monotonic()
        log, new = self.engine.step_log, []
        for record in reversed(log):
            if record.step <= self._steps_sent:
                break
            new.append(record)
        if new:
            self._steps_sent = log[-1].step
            self.s.outbox.put(AppendSteps(self.s.keys.steps(self.s.cfg.name), new[::-1]))

    def _apply(self, command: Command) -> None:
        job, s = command.job, self.s
        if s.jobs.get(job.rid) is not job:
            return  # finished or dropped meanwhile
        if isinstance(command, Add):
            self._add(job)
        elif isinstance(command, Drop):  # not ours any more: no answer from here
            self.engine.abort(job.rid)
            s.jobs.pop(job.rid, None)
        elif isinstance(command, Cancel) and job.started:  # (an unstarted job: its Add sees job.cancelled)
            self.engine.abort(job.rid)
            self._end(job, self._done(job, "cancelled", None))

    def _add(self, job: Job) -> None:
        s = self.s
        if job.cancelled:
            self._end(job, self._done(job, "cancelled", []))
            return
        try:
            prompt = self._prompt(job)
            # a text prompt is counted here, before the engine sees it (a token-id prompt was counted at intake,
            # unless a continuation grew it here)
            counted = isinstance(prompt, list) and job.request.continuation is None
            why = None if counted else s.cfg.limits.check_prompt_tokens(
                len(prompt) if isinstance(prompt, list) else len(self.engine.tokenizer(prompt).input_ids))
            if why:
                self._end(job, error_event(job, "limit_exceeded", why))
                return
            params = SamplingParams(**job.request.params.model_dump())
            if job.kv is not None:
                self._import(job, prompt)
            if job.prefill_only:  # the real params are checked here; the decode replica runs them
                params.validate()
                params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            self.engine.add_request(job.rid, prompt, params)
            job.started = True
        except (ValueError, TypeError) as e:
            self._end(job, error_event(job, "invalid_request", str(e)))
        except Exception as e:  # a bug, not the request's fault: report it, keep serving
            log.exception("add_request %s", job.rid)
            self.engine.abort(job.rid)
            self._end(job, error_event(job, "engine_error", f"{type(e).__name__}: {e}"))

    def _import(self, job: Job, prompt: str | list[int]) -> None:
        """A prefill replica's blocks into this engine's prefix cache; what does not fit is computed again."""
        ids = prompt if isinstance(prompt, list) else self.engine.tokenizer(prompt).input_ids
        try:
            job.handover["imported_tokens"] = import_prompt_blocks(self.engine, ids, job.kv)
        except ValueError as e:  # another model, block size or KV dtype: recompute
            log.warning("request %s: %s", job.rid, e)
        job.kv = None

    def _prompt(self, job: Job) -> str | list[int]:
        req = job.request
        prompt = req.prompt if req.messages is None else chat_prompt(req, self.engine.tokenizer)
        if req.continuation is None:
            return prompt
        # token ids, tokenized as the engine would the text (admission.check_request): the shared prefix then
        # has the same ids, so it hits the prefix cache
        tok = self.engine.tokenizer
        ids = list(prompt) if isinstance(prompt, list) else tok(prompt).input_ids
        for part in req.continuation.parts:
            ids += part if isinstance(part, list) else tok(part, add_special_tokens=False).input_ids
        return ids

    def _check_deadlines(self) -> None:
        now = time.time()
        for job in [j for j in list(self.s.jobs.values()) if j.started and j.request.deadline is not None]:
            if now > job.request.deadline:
                self.engine.abort(job.rid)
                self._end(job, error_event(job, "deadline_exceeded", "deadline passed during generation"))

    def _fail_all(self, code: str, message: str) -> None:
        for job in [j for j in list(self.s.jobs.values()) if j.started]:
            self.engine.abort(job.rid)
            self._end(job, error_event(job, code, message))
        self.s.engine_error = message

    def _on_output(self, job: Job, out, now: float) -> None:
        s = self.s
        job.prompt_tokens = len(out.prompt_token_ids)
        if job.prefill_only:  # its prompt is computed: the blocks and the request go to a decode replica
            if out.error is not None:
                self._end(job, error_event(job, "engine_error", out.error))
            elif out.finished:
                s.hand_over(job, export_prompt_blocks(self.engine, out.prompt_token_ids))
            return
        for ev in token_events(job, out, self.engine.tokenizer):
            s.outbox.put(Publish(job.rid, encode(ev)))
            s.metrics.generated.inc(len(ev.token_ids))
        if out.metrics is not None and out.metrics.spec is not None:
            job.spec = out.metrics.spec
        if job.first_token_at is None:
            job.first_token_at = now
            s.metrics.ttft.observe(max(0.0, now - job.request.created_at))  # clocks of other hosts may differ
        elif job.last_token_at is not None:
            s.metrics.itl.observe(now - job.last_token_at)
        job.last_token_at = now
        if out.error is not None:  # the engine ended this request alone (engine/isolation.py)
            self._end(job, error_event(job, "engine_error", out.error))
        elif out.finished:
            self._end(job, self._done(job, out.outputs[0].finish_reason, out.outputs))

    def _done(self, job: Job, reason: str | None, outputs) -> DoneEvent:
        ev = done_event(job, reason, outputs, self.engine.tokenizer, self.s.cfg.name)
        m = self.s.metrics
        if ev.metrics.tpot_s is not None:
            m.tpot.observe(ev.metrics.tpot_s)
        m.e2e.observe(max(0.0, ev.metrics.e2e_s))
        m.prompt_tokens.inc(job.prompt_tokens)
        return ev
