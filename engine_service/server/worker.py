"""An engine replica: pulls requests from the Redis stream into the engine's running batch, streams tokens back.

Threads: `engine` (add/abort/step: the only thread touching the engine), `intake` (XREADGROUP /
XAUTOCLAIM as free capacity allows), `publish` (pipelines PUBLISH and the atomic finish script),
`control` (cancel channel, heartbeats). Redis I/O never runs on the engine thread.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, ValidationError
from redis.exceptions import ResponseError

from engine_service.server.kv_snapshot import kv_snapshot
from engine_service.engine.sampling_params import SamplingParams
from shared.keys import Keys
from shared.limits import Limits
from shared.protocol import (PROTOCOL_VERSION, REQUEST_ID_PATTERN, Completion, DoneEvent, ErrorEvent,
                             GenerationRequest, Metrics, TokenEvent, TokenLogprob, decode_request, encode,
                             validation_message)
from shared.scripts import FINISH, HEARTBEAT

log = logging.getLogger("decodelab.worker")

_CONN_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
LATENCY_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 40, 80)


def default_replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


@dataclass
class WorkerConfig:
    redis_url: str
    keys: Keys = field(default_factory=Keys.from_env)
    name: str = field(default_factory=default_replica_name)
    model_name: str = ""
    claim_idle_s: float = 10.0  # a pending entry idle this long (its replica is gone) is claimed by another
    result_ttl_s: int = 3600
    read_block_ms: int = 100
    expected_tokens: int = 256  # per-request KV estimate (prompt + output) when deciding how much to pull
    max_pull: int = 16  # most entries taken in one read
    stats_interval_s: float = 0.25  # engine.stats() refresh (capacity, /metrics); it walks every KV block
    kv_snapshot_ttl_s: float = 6.0  # the KV snapshot key (playground block map) outlives a stalled replica this long
    limits: Limits = field(default_factory=Limits.from_env)

    @property
    def heartbeat_s(self) -> float:
        return min(1.0, self.claim_idle_s / 4)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry):
        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"decodelab_{name}", doc, buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "Request created -> first token")
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive token events of a request")
        self.queue = hist("queue_time_seconds", "Request created -> picked up by a replica")
        self.e2e = hist("e2e_request_latency_seconds", "Request created -> finished")
        self.batch = hist("batch_size", "Requests advanced per engine step", (1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.finished = Counter("decodelab_requests", "Finished requests by outcome", ["outcome"], registry=registry)
        self.prompt_tokens = Counter("decodelab_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generated = Counter("decodelab_generation_tokens", "Tokens generated", registry=registry)


@dataclass(eq=False)
class Job:
    request: GenerationRequest
    entry_id: str
    attempt: int
    picked_at: float
    seq: int = 0
    sent: dict[int, tuple[str, list[int]]] = field(default_factory=dict)  # index -> (text, token ids) published
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_tokens: int = 0
    cancelled: bool = False
    started: bool = False
    spec: dict | None = None  # the engine's speculative counters (RequestMetrics.spec), latest

    @property
    def rid(self) -> str:
        return self.request.request_id

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1


def _logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]]) -> list[TokenLogprob]:
    def lp(x: float) -> float | None:
        return x if x > float("-inf") else None

    out = []
    for tid, top in zip(token_ids, entries):
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        out.append(TokenLogprob(token_id=tid, token=tokenizer.decode([tid]), logprob=lp(top.get(tid, float("-inf"))),
                                top=[(t, tokenizer.decode([t]), lp(v)) for t, v in ranked]))
    return out


class Worker:
    def __init__(self, engine, config: WorkerConfig, metrics: WorkerMetrics | None = None):
        self.engine, self.cfg, self.keys = engine, config, config.keys
        self.metrics = metrics or WorkerMetrics(CollectorRegistry())
        # encoding_errors="replace": a stream entry that is not UTF-8 becomes a refused request, not an intake error
        self.redis = redis.Redis.from_url(config.redis_url, decode_responses=True, encoding_errors="replace",
                                          socket_connect_timeout=2,
                                          socket_timeout=config.read_block_ms / 1000 + 5, health_check_interval=5)
        self._finish = self.redis.register_script(FINISH)
        self._heartbeat = self.redis.register_script(HEARTBEAT)
        self.jobs: dict[str, Job] = {}  # running on this replica (pulled, not yet finished)
        self._control: queue.Queue = queue.Queue()  # -> engine thread
        self._outbox: queue.Queue = queue.Queue()  # -> publish thread
        self._stop = threading.Event()
        self._pulling = threading.Event()
        self._pulling.set()
        self._threads: list[threading.Thread] = []
        self.stats: dict = engine.stats()
        self._stats_at = 0.0
        self._kv_last: dict | None = None
        self._kv_sent_at = 0.0
        self.max_batch = 0
        self.redis_ok = False
        self.queue_length = 0
        self.engine_error: str | None = None

    # ---- lifecycle
    def start(self) -> Worker:
        for name in ("engine", "intake", "publish", "control"):
            t = threading.Thread(target=getattr(self, f"_{name}_loop"), name=f"worker-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def drain(self, timeout: float) -> bool:
        """Stop pulling and let running requests finish (True if all did within timeout)."""
        self._pulling.clear()
        end = time.monotonic() + timeout
        while self.jobs and time.monotonic() < end:
            time.sleep(0.05)
        return not self.jobs

    def stop(self, timeout: float = 5.0) -> None:
        self._pulling.clear()
        self._stop.set()
        self._control.put(None)
        for t in self._threads:
            t.join(timeout)
        self.redis.close()

    # ---- capacity: how many more requests this replica should take now
    def capacity(self) -> int:
        free_seqs = self.engine.config.max_num_seqs - len(self.jobs)
        st = self.stats
        if st.get("num_waiting", 0) > 0 and self.jobs:
            return 0  # the engine already has a backlog it cannot schedule
        unstarted = sum(1 for j in list(self.jobs.values()) if not j.started)
        per_request = -(-self.cfg.expected_tokens // st.get("block_size", 16))
        by_blocks = st.get("blocks_free", 0) // per_request - unstarted
        cap = min(free_seqs, by_blocks, self.cfg.max_pull)
        return max(cap, 1) if not self.jobs else max(cap, 0)

    # ---- engine thread
    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._control.get_nowait() if self.engine.has_unfinished() else self._control.get(timeout=0.05)
            except queue.Empty:
                item = None
            while item is not None:
                self._handle_control(*item)
                try:
                    item = self._control.get_nowait()
                except queue.Empty:
                    item = None
            self._check_deadlines()
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # keep serving: fail what was running, not the replica
                    log.exception("engine step failed")
                    self._fail_all("engine_error", f"engine step failed: {type(e).__name__}: {e}")
                    continue
                now = time.time()
                if outputs:
                    self.max_batch = max(self.max_batch, len(outputs))
                    self.metrics.batch.observe(len(outputs))
                for out in outputs:
                    if (job := self.jobs.get(out.request_id)) is not None:
                        try:
                            self._on_output(job, out, now)
                        except Exception as e:  # fail this request, keep the others
                            log.exception("output of %s", job.rid)
                            self.engine.abort(job.rid)
                            self._end(job, self._error(job, "engine_error", f"{type(e).__name__}: {e}"))
            if time.monotonic() - self._stats_at > self.cfg.stats_interval_s:
                self.stats, self._stats_at = self.engine.stats(), time.monotonic()
                self._snapshot_kv()

    def _snapshot_kv(self) -> None:
        """Queue the KV picture for Redis when it changed (else every 2 s, to keep the key alive)."""
        snap = kv_snapshot(self.engine, self.cfg.name, self.cfg.model_name, self.stats)
        body = snap.model_dump(exclude={"at"})
        if body != self._kv_last or time.monotonic() - self._kv_sent_at > 2.0:
            self._kv_last, self._kv_sent_at = body, time.monotonic()
            self._outbox.put(("kv", self.keys.kv(self.cfg.name), encode(snap)))

    def _handle_control(self, op: str, job: Job) -> None:
        if op == "add":
            if job.cancelled:
                self._end(job, self._done(job, "cancelled", []))
                return
            try:
                req = job.request
                prompt = req.prompt
                if req.messages is not None:
                    try:
                        prompt = self.engine.tokenizer.apply_chat_template(
                            [m.model_dump() for m in req.messages], tokenize=False, add_generation_prompt=True)
                    except Exception as e:  # jinja's TemplateError (raise_exception in the template), ...
                        raise ValueError(f"messages: the model's chat template refused them: {e}") from None
                if isinstance(prompt, str):  # counted before the engine sees it (a token-id prompt at intake)
                    if (why := self.cfg.limits.check_prompt_tokens(len(self.engine.tokenizer(prompt).input_ids))):
                        self._end(job, self._error(job, "limit_exceeded", why))
                        return
                self.engine.add_request(job.rid, prompt, SamplingParams(**req.params.model_dump()))
                job.started = True
            except (ValueError, TypeError) as e:
                self._end(job, self._error(job, "invalid_request", str(e)))
            except Exception as e:  # a bug, not the request's fault: report it, keep serving
                log.exception("add_request %s", job.rid)
                self.engine.abort(job.rid)
                self._end(job, self._error(job, "engine_error", f"{type(e).__name__}: {e}"))
        elif self.jobs.get(job.rid) is not job or not job.started:
            return  # finished meanwhile, or not in the engine yet (the "add" will see job.cancelled)
        elif op == "cancel":
            self.engine.abort(job.rid)
            self._end(job, self._done(job, "cancelled", None))
        elif op == "drop":  # another replica owns it now; it will finish it
            self.engine.abort(job.rid)
            self.jobs.pop(job.rid, None)

    def _check_deadlines(self) -> None:
        now = time.time()
        for job in [j for j in list(self.jobs.values()) if j.started and j.request.deadline is not None]:
            if now > job.request.deadline:
                self.engine.abort(job.rid)
                self._end(job, self._error(job, "deadline_exceeded", "deadline passed during generation"))

    def _fail_all(self, code: str, message: str) -> None:
        for job in [j for j in list(self.jobs.values()) if j.started]:
            self.engine.abort(job.rid)
            self._end(job, self._error(job, code, message))
        self.engine_error = message

    def _on_output(self, job: Job, out, now: float) -> None:
        job.prompt_tokens = len(out.prompt_token_ids)
        for comp in out.outputs:
            sent_text, sent_ids = job.sent.get(comp.index, ("", []))
            if comp.token_ids == sent_ids and comp.text == sent_text:
                continue
            reset = not (comp.text.startswith(sent_text) and comp.token_ids[:len(sent_ids)] == sent_ids)
            start = 0 if reset else len(sent_ids)
            new_ids = comp.token_ids[start:]
            logprobs = None
            if comp.logprobs is not None:
                logprobs = _logprobs(self.engine.tokenizer, new_ids, comp.logprobs[start:])
            marks = getattr(comp, "spec_marks", None)
            ev = TokenEvent(request_id=job.rid, seq=job.next_seq(), attempt=job.attempt, index=comp.index,
                            text_delta=comp.text if reset else comp.text[len(sent_text):], token_ids=new_ids,
                            reset=reset, logprobs=logprobs, spec=marks[start:] if marks is not None else None)
            job.sent[comp.index] = (comp.text, list(comp.token_ids))
            self._outbox.put(("publish", job.rid, encode(ev)))
            self.metrics.generated.inc(len(new_ids))
        if out.metrics is not None and out.metrics.spec is not None:
            job.spec = out.metrics.spec
        if job.first_token_at is None:
            job.first_token_at = now
            self.metrics.ttft.observe(max(0.0, now - job.request.created_at))  # clocks of other hosts may differ
        elif job.last_token_at is not None:
            self.metrics.itl.observe(now - job.last_token_at)
        job.last_token_at = now
        if out.finished:
            self._end(job, self._done(job, out.outputs[0].finish_reason, out.outputs))

    def _done(self, job: Job, reason: str | None, outputs) -> DoneEvent:
        if not outputs:  # cancelled: what was streamed so far
            sent = sorted(job.sent.items()) or [(0, ("", []))]
            outputs = [Completion(index=i, text=text, token_ids=ids, finish_reason=reason) for i, (text, ids) in sent]
        else:
            tok = self.engine.tokenizer
            outputs = [Completion(index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason,
                                  cumulative_logprob=c.cumulative_logprob,
                                  logprobs=_logprobs(tok, c.token_ids, c.logprobs) if c.logprobs is not None else None,
                                  score=getattr(c, "score", None), spec=getattr(c, "spec_marks", None))
                       for c in outputs]
        now = time.time()
        created = job.request.created_at
        n_out = max(len(c.token_ids) for c in outputs)
        tpot = None
        if job.first_token_at is not None and n_out > 1:
            tpot = (job.last_token_at - job.first_token_at) / (n_out - 1)
        metrics = Metrics(replica=self.cfg.name, prompt_tokens=job.prompt_tokens, completion_tokens=n_out,
                          queue_s=job.picked_at - created, e2e_s=now - created, tpot_s=tpot, spec=job.spec,
                          ttft_s=None if job.first_token_at is None else job.first_token_at - created)
        if tpot is not None:
            self.metrics.tpot.observe(tpot)
        self.metrics.e2e.observe(max(0.0, now - created))
        self.metrics.prompt_tokens.inc(job.prompt_tokens)
        return DoneEvent(request_id=job.rid, seq=job.next_seq(), attempt=job.attempt, finish_reason=reason,
                         text=outputs[0].text, outputs=outputs, metrics=metrics)

    def _error(self, job: Job, code: str, message: str) -> ErrorEvent:
        return ErrorEvent(request_id=job.rid, seq=job.next_seq(), attempt=job.attempt, code=code, message=message)

    def _end(self, job: Job, terminal: DoneEvent | ErrorEvent) -> None:
        self.jobs.pop(job.rid, None)
        outcome = terminal.finish_reason if isinstance(terminal, DoneEvent) else terminal.code
        self.metrics.finished.labels(outcome or "unknown").inc()
        self._outbox.put(("finish", job.rid, job.entry_id, encode(terminal), job.request.client_id))

    # ---- intake thread
    def _intake_loop(self) -> None:
        group_ok, last_claim, delay = False, 0.0, 0.1
        while not self._stop.is_set():
            try:
                if not group_ok:
                    self._ensure_group()
                    group_ok = True
                cap = self.capacity() if self._pulling.is_set() else 0
                if cap <= 0:
                    time.sleep(0.02)
                    continue
                entries = []
                if time.monotonic() - last_claim >= self.cfg.claim_idle_s / 2:
                    entries = self._autoclaim(cap)
                    last_claim = time.monotonic()
                if len(entries) < cap:
                    for _, batch in self.redis.xreadgroup(self.keys.group, self.cfg.name, {self.keys.stream: ">"},
                                                          count=cap - len(entries), block=self.cfg.read_block_ms) or []:
                        entries.extend(batch)
                for entry_id, fields in entries:
                    self._accept(entry_id, fields)
                self.redis_ok, delay = True, 0.1
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    log.exception("intake")
                group_ok = False
                time.sleep(delay)
            except _CONN_ERRORS as e:
                self.redis_ok, group_ok = False, False
                log.warning("intake: Redis unreachable (%s); retrying in %.1fs", e, delay)
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
            except Exception:  # one bad entry or reply must not stop this replica from pulling
                log.exception("intake")
                time.sleep(delay)

    def _ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.keys.stream, self.keys.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _autoclaim(self, cap: int) -> list:
        claimed, start = [], "0-0"
        for _ in range(64):  # walk the whole pending list, `cap` entries at a time
            resp = self.redis.xautoclaim(self.keys.stream, self.keys.group, self.cfg.name,
                                         int(self.cfg.claim_idle_s * 1000), start_id=start, count=cap)
            start, entries = resp[0], resp[1]
            if any(entry_id is None for entry_id, _ in entries):  # Redis 6.2: deleted entries come back as nil
                self._ack_deleted()
            claimed.extend(e for e in entries if e[0] is not None)
            if len(claimed) >= cap or start in ("0-0", b"0-0"):
                break
        return claimed

    def _ack_deleted(self) -> None:
        """Acknowledge our pending entries whose stream entry no longer exists (someone XDEL'd or trimmed it)."""
        for p in self.redis.xpending_range(self.keys.stream, self.keys.group, min="-", max="+", count=256,
                                           consumername=self.cfg.name):
            if not self.redis.xrange(self.keys.stream, p["message_id"], p["message_id"]):
                self.redis.xack(self.keys.stream, self.keys.group, p["message_id"])

    def _accept(self, entry_id: str, fields: dict | None) -> None:
        fields = fields or {}
        rid = fields.get("id")
        if rid is None or "data" not in fields:  # nothing to answer to: drop it
            log.warning("dropping malformed stream entry %s", entry_id)
            self.redis.xack(self.keys.stream, self.keys.group, entry_id)
            self.redis.xdel(self.keys.stream, entry_id)
            return
        if rid in self.jobs:
            return  # ours already (claimed back after a stall)
        now = time.time()
        request = None
        try:
            if fields.get("v") != str(PROTOCOL_VERSION):
                raise _Refused("unsupported_version",
                               f"protocol version {fields.get('v')!r}; this replica speaks {PROTOCOL_VERSION}")
            if (why := self.cfg.limits.check_size(len(fields["data"].encode()))):
                raise _Refused("limit_exceeded", why)
            try:
                request = decode_request(fields["data"])
            except ValidationError as e:
                raise _Refused("invalid_request", validation_message(e.errors())) from None
            if (why := self.cfg.limits.check(request)):
                raise _Refused("limit_exceeded", why)
            if request.request_id != rid:
                raise _Refused("invalid_request", "request_id does not match the stream entry")
            if request.model and self.cfg.model_name and request.model != self.cfg.model_name:
                raise _Refused("invalid_request", f"model {request.model!r} is not served (serving "
                                                  f"{self.cfg.model_name!r})")
        except _Refused as e:
            client_id = request.client_id if request is not None else ""  # frees its slot when the finish runs
            job = Job(GenerationRequest(request_id=_safe_id(rid, entry_id), prompt="", client_id=client_id),
                      entry_id, 1, now)
            self._end(job, self._error(job, e.code, e.message))
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(self.keys.result(rid))
        pipe.exists(self.keys.cancelled(rid))
        pipe.incr(self.keys.attempt(rid))
        pipe.expire(self.keys.attempt(rid), self.cfg.result_ttl_s)
        pipe.set(self.keys.owner(rid), self.cfg.name, px=int(self.cfg.claim_idle_s * 2000))
        has_result, cancelled, attempt, *_ = pipe.execute()
        job = Job(request, entry_id, int(attempt), now)
        if has_result:  # finished by a replica that died before acknowledging: nothing to redo
            self.redis.xack(self.keys.stream, self.keys.group, entry_id)
            self.redis.xdel(self.keys.stream, entry_id)
            self.redis.delete(self.keys.owner(rid))
            return
        self.metrics.queue.observe(max(0.0, now - request.created_at))
        if request.deadline is not None and now > request.deadline:
            self._end(job, self._error(job, "deadline_exceeded", "deadline passed while queued"))
            return
        job.cancelled = bool(cancelled)
        self.jobs[rid] = job
        self._control.put(("add", job))

    # ---- publish thread
    def _publish_loop(self) -> None:
        pending: list = []
        delay = 0.05
        while not (self._stop.is_set() and not pending and self._outbox.empty()):
            try:
                pending.append(self._outbox.get(timeout=0.1))
            except queue.Empty:
                if not pending:
                    continue
            while len(pending) < 512:
                try:
                    pending.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                pipe = self.redis.pipeline(transaction=False)
                for item in pending:
                    if item[0] == "publish":
                        pipe.publish(self.keys.events(item[1]), item[2])
                    elif item[0] == "kv":
                        pipe.set(item[1], item[2], px=int(self.cfg.kv_snapshot_ttl_s * 1000))
                    else:
                        _, rid, entry_id, payload, client_id = item
                        self._finish(keys=[self.keys.result(rid), self.keys.events(rid), self.keys.stream,
                                           self.keys.owner(rid), self.keys.client(client_id)],
                                     args=[self.keys.group, entry_id, payload, self.cfg.result_ttl_s, rid], client=pipe)
                for reply in pipe.execute(raise_on_error=False):
                    if isinstance(reply, Exception):
                        log.error("publish: Redis refused a command: %s", reply)
                pending, delay = [], 0.05
            except _CONN_ERRORS as e:
                # Token events lost in an outage are repaired by clients from the result key; results are kept.
                pending = [item for item in pending if item[0] == "finish"]
                log.warning("publish: Redis unreachable (%s); %d results held", e, len(pending))
                if self._stop.wait(delay) and delay >= 1.0:
                    return
                delay = min(2 * delay, 1.0)

    # ---- control thread: cancellations and heartbeats
    def _control_loop(self) -> None:
        pubsub, last_beat, delay = None, 0.0, 0.1
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self.keys.cancel_channel)
                msg = pubsub.get_message(timeout=0.1)
                if msg and msg["type"] == "message" and (job := self.jobs.get(msg["data"])) is not None:
                    job.cancelled = True
                    self._control.put(("cancel", job))
                if time.monotonic() - last_beat >= self.cfg.heartbeat_s:
                    last_beat = time.monotonic()
                    self._beat()
                delay = 0.1
            except _CONN_ERRORS as e:
                self.redis_ok = False
                log.warning("control: Redis unreachable (%s)", e)
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass
                pubsub = None
                self._stop.wait(delay)
                delay = min(2 * delay, 2.0)
            except Exception:  # e.g. a script error: keep cancelling and heart-beating
                log.exception("control")
                self._stop.wait(delay)
        if pubsub is not None:
            pubsub.close()

    def _beat(self) -> None:
        jobs = list(self.jobs.values())
        args = [self.keys.group, self.cfg.name, self.keys.owner(""), int(self.cfg.claim_idle_s * 2000)]
        for job in jobs:
            args += [job.entry_id, job.rid]
        lost = self._heartbeat(keys=[self.keys.stream], args=args) if jobs else []
        for rid in lost:
            if (job := self.jobs.get(rid)) is not None:
                log.warning("request %s was claimed by another replica; dropping it here", rid)
                self._control.put(("drop", job))
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.replica(self.cfg.name), encode(_ReplicaInfo(
            model=self.cfg.model_name, running=len(jobs), capacity=self.capacity())),
            px=int(self.cfg.heartbeat_s * 3000))
        pipe.xlen(self.keys.stream)
        pipe.xpending(self.keys.stream, self.keys.group)
        _, length, pending = pipe.execute(raise_on_error=False)
        if isinstance(length, int) and isinstance(pending, dict):
            self.queue_length = max(0, length - pending["pending"])
        self.redis_ok = True


class _ReplicaInfo(BaseModel):
    model: str
    running: int
    capacity: int


class _Refused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _safe_id(rid: str, entry_id: str) -> str:
    return rid if re.fullmatch(REQUEST_ID_PATTERN, rid) else f"invalid-{entry_id}"




def add_parser(subparsers, add_engine_args) -> None:
    """`decodelab engine` (registered by cli.py); the command itself lives in api.py."""
    from engine_service.server.api import add_engine_parser

    add_engine_parser(subparsers, add_engine_args)
