"""The intake thread: pulls requests from the Redis stream (XREADGROUP, and XAUTOCLAIM of entries whose replica
died) as free capacity allows, refuses what it must, and hands the rest to the engine thread."""
from __future__ import annotations

import logging
import re
import time

from pydantic import ValidationError
from redis.exceptions import ResponseError

from engine_service.server.events import error_event
from engine_service.server.jobs import Add, Job
from engine_service.server.state import CONN_ERRORS, ReplicaState
from shared.protocol import PROTOCOL_VERSION, REQUEST_ID_PATTERN, GenerationRequest, decode_request, validation_message

log = logging.getLogger("decodelab.replica")


class Refused(Exception):
    """A stream entry this replica answers with an error instead of running it."""

    def __init__(self, code: str, message: str, client_id: str = ""):
        super().__init__(message)
        self.code, self.message = code, message
        self.client_id = client_id  # frees the client's slot when the finish runs


class Intake:
    def __init__(self, state: ReplicaState):
        self.s = state

    def run(self) -> None:
        s = self.s
        group_ok, last_claim, delay = False, 0.0, 0.1
        while not s.stop.is_set():
            try:
                if not group_ok:
                    self._ensure_group()
                    group_ok = True
                cap = s.capacity() if s.pulling.is_set() else 0
                if cap <= 0:
                    time.sleep(0.02)
                    continue
                entries = []
                if time.monotonic() - last_claim >= s.cfg.claim_idle_s / 2:
                    entries = self._autoclaim(cap)
                    last_claim = time.monotonic()
                if len(entries) < cap:
                    for _, batch in s.redis.xreadgroup(s.keys.group, s.cfg.name, {s.keys.stream: ">"},
                                                       count=cap - len(entries), block=s.cfg.read_block_ms) or []:
                        entries.extend(batch)
                for entry_id, fields in entries:
                    self.accept(entry_id, fields)
                s.redis_ok, delay = True, 0.1
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    log.exception("intake")
                group_ok = False
                time.sleep(delay)
            except CONN_ERRORS as e:
                s.redis_ok, group_ok = False, False
                log.warning("intake: Redis unreachable (%s); retrying in %.1fs", e, delay)
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
            except Exception:  # one bad entry or reply must not stop this replica from pulling
                log.exception("intake")
                time.sleep(delay)

    def _ensure_group(self) -> None:
        try:
            self.s.redis.xgroup_create(self.s.keys.stream, self.s.keys.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _autoclaim(self, cap: int) -> list:
        s = self.s
        claimed, start = [], "0-0"
        for _ in range(64):  # walk the whole pending list, `cap` entries at a time
            start, entries, *_ = s.redis.xautoclaim(s.keys.stream, s.keys.group, s.cfg.name,
                                                    int(s.cfg.claim_idle_s * 1000), start_id=start, count=cap)
            if any(entry_id is None for entry_id, _ in entries):  # Redis 6.2: deleted entries come back as nil
                self._ack_deleted()
            claimed.extend(e for e in entries if e[0] is not None)
            if len(claimed) >= cap or start in ("0-0", b"0-0"):
                break
        return claimed

    def _ack_deleted(self) -> None:
        """Acknowledge our pending entries whose stream entry no longer exists (someone XDEL'd or trimmed it)."""
        s = self.s
        for p in s.redis.xpending_range(s.keys.stream, s.keys.group, min="-", max="+", count=256,
                                        consumername=s.cfg.name):
            if not s.redis.xrange(s.keys.stream, p["message_id"], p["message_id"]):
                s.redis.xack(s.keys.stream, s.keys.group, p["message_id"])

    def _validate(self, rid: str, fields: dict) -> GenerationRequest:
        cfg = self.s.cfg
        if fields.get("v") != str(PROTOCOL_VERSION):
            raise Refused("unsupported_version",
                          f"protocol version {fields.get('v')!r}; this replica speaks {PROTOCOL_VERSION}")
        if (why := cfg.limits.check_size(len(fields["data"].encode()))):
            raise Refused("limit_exceeded", why)
        try:
            request = decode_request(fields["data"])
        except ValidationError as e:
            raise Refused("invalid_request", validation_message(e.errors())) from None
        if (why := cfg.limits.check(request)):
            raise Refused("limit_exceeded", why, request.client_id)
        if request.request_id != rid:
            raise Refused("invalid_request", "request_id does not match the stream entry", request.client_id)
        if request.model and cfg.model_name and request.model != cfg.model_name:
            raise Refused("invalid_request", f"model {request.model!r} is not served (serving {cfg.model_name!r})",
                          request.client_id)
        return request

    def accept(self, entry_id: str, fields: dict | None) -> None:
        s = self.s
        fields = fields or {}
        rid = fields.get("id")
        if rid is None or "data" not in fields:  # nothing to answer to: drop it
            log.warning("dropping malformed stream entry %s", entry_id)
            s.redis.xack(s.keys.stream, s.keys.group, entry_id)
            s.redis.xdel(s.keys.stream, entry_id)
            return
        if rid in s.jobs:
            return  # ours already (claimed back after a stall)
        now = time.time()
        try:
            request = self._validate(rid, fields)
        except Refused as e:
            job = Job(GenerationRequest(request_id=_safe_id(rid, entry_id), prompt="", client_id=e.client_id),
                      entry_id, 1, now)
            s.end(job, error_event(job, e.code, e.message))
            return
        # Registered before the cancel mark is read: a cancel published from here on finds the job (control
        # thread), and one published earlier left its mark, which the pipeline below reads.
        job = Job(request, entry_id, 0, now)
        s.jobs[rid] = job
        pipe = s.redis.pipeline(transaction=False)
        pipe.exists(s.keys.result(rid))
        pipe.exists(s.keys.cancelled(rid))
        pipe.incr(s.keys.attempt(rid))
        pipe.expire(s.keys.attempt(rid), s.cfg.result_ttl_s)
        pipe.set(s.keys.owner(rid), s.cfg.name, px=int(s.cfg.claim_idle_s * 2000))
        try:
            has_result, cancelled, attempt, *_ = pipe.execute()
        except BaseException:
            s.jobs.pop(rid, None)  # the entry stays pending; it is claimed again later
            raise
        job.attempt = int(attempt)
        if has_result:  # finished by a replica that died before acknowledging: nothing to redo
            s.jobs.pop(rid, None)
            s.redis.xack(s.keys.stream, s.keys.group, entry_id)
            s.redis.xdel(s.keys.stream, entry_id)
            s.redis.delete(s.keys.owner(rid))
            return
        s.metrics.queue.observe(max(0.0, now - request.created_at))
        if job.attempt > s.cfg.max_attempts:  # every earlier run took its replica down: stop the cycle
            self._dead_letter(entry_id, fields, job.attempt)
            s.end(job, error_event(job, "too_many_attempts",
                                   f"replicas stopped while running this request {job.attempt - 1} times; it was "
                                   f"moved to the dead-letter stream {s.keys.dead_letter} and will not be run again"))
            return
        if request.deadline is not None and now > request.deadline:
            s.end(job, error_event(job, "deadline_exceeded", "deadline passed while queued"))
            return
        job.cancelled = job.cancelled or bool(cancelled)
        s.commands.put(Add(job))

    def _dead_letter(self, entry_id: str, fields: dict, attempts: int) -> None:
        s = self.s
        s.redis.xadd(s.keys.dead_letter, {**fields, "entry": entry_id, "attempts": str(attempts),
                                          "replica": s.cfg.name}, maxlen=10_000, approximate=True)
        log.error("request %s moved to the dead-letter stream after %d attempts", fields.get("id"), attempts)


def _safe_id(rid: str, entry_id: str) -> str:
    return rid if re.fullmatch(REQUEST_ID_PATTERN, rid) else f"invalid-{entry_id}"
