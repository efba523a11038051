"""The intake thread: pulls requests from Redis as free capacity allows, refuses what it must, and hands the rest to
the engine thread.

It reads its own stream (requests routed to it, shared/router.py) and the shared stream in one XREADGROUP; claims
(XAUTOCLAIM) entries that a dead replica left pending on any registered stream; and steals from other replicas'
streams what waits there too long (`steal_after_s`) or whose replica is gone or draining. Every stream has the same
consumer group, so an entry is delivered to one replica at a time however it gets there."""
from __future__ import annotations

import json
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
STEAL_CHECK_S = 0.25  # how often an idle replica looks at the other replicas' queues


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
        group_ok, last_claim, last_steal, delay = False, 0.0, 0.0, 0.1
        while not s.stop.is_set():
            try:
                if not group_ok:
                    self._ensure_group()
                    group_ok = True
                cap = s.capacity() if s.pulling.is_set() else 0
                if cap <= 0:
                    time.sleep(0.02)
                    continue
                entries: list[tuple[str, str, dict]] = []  # (stream, entry id, fields)
                if time.monotonic() - last_claim >= s.cfg.claim_idle_s / 2:
                    entries = self._autoclaim(cap)
                    last_claim = time.monotonic()
                if len(entries) < cap:
                    entries += self._read({s.cfg.own_stream: ">", s.keys.stream: ">"}, cap - len(entries),
                                          s.cfg.read_block_ms)
                if len(entries) < cap and time.monotonic() - last_steal >= STEAL_CHECK_S:
                    entries += self._steal(cap - len(entries))
                    last_steal = time.monotonic()
                for stream, entry_id, fields in entries:
                    self.accept(entry_id, fields, stream)
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
        s = self.s
        for stream in (s.keys.stream, s.cfg.own_stream):
            try:
                s.redis.xgroup_create(stream, s.keys.group, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            s.redis.sadd(s.keys.streams, stream)

    def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[tuple[str, str, dict]]:
        out = []
        for stream, batch in self.s.redis.xreadgroup(self.s.keys.group, self.s.cfg.name, streams, count=count,
                                                     block=block) or []:
            out.extend((stream, entry_id, fields) for entry_id, fields in batch)
        return out

    def _autoclaim(self, cap: int) -> list[tuple[str, str, dict]]:
        """Entries a dead replica left pending (idle past claim_idle_s), on every registered stream."""
        s = self.s
        claimed = []
        for stream in sorted(s.redis.smembers(s.keys.streams)):
            start = "0-0"
            for _ in range(64):  # walk the whole pending list, `cap` entries at a time
                try:
                    start, entries, *_ = s.redis.xautoclaim(stream, s.keys.group, s.cfg.name,
                                                            int(s.cfg.claim_idle_s * 1000), start_id=start, count=cap)
                except ResponseError as e:  # a registered stream that is gone (NOGROUP): nothing to claim there
                    if "NOGROUP" not in str(e):
                        raise
                    break
                if any(entry_id is None for entry_id, _ in entries):  # Redis 6.2: deleted entries come back as nil
                    self._ack_deleted(stream)
                claimed.extend((stream, *e) for e in entries if e[0] is not None)
                if len(claimed) >= cap or start in ("0-0", b"0-0"):
                    break
            if len(claimed) >= cap:
                break
        return claimed

    def _steal(self, cap: int) -> list[tuple[str, str, dict]]:
        """Take what waits in other replicas' queues: all of it when the replica is gone or draining, else the
        entries that have waited longer than steal_after_s (one per check: the owner may catch up)."""
        s, keys = self.s, self.s.keys
        own = {keys.stream, s.cfg.own_stream}
        streams = [st for st in sorted(s.redis.smembers(keys.streams)) if st not in own]
        if not streams:
            return []
        owners = [st.removeprefix(keys.replica_stream("")) for st in streams]
        pipe = s.redis.pipeline(transaction=False)
        pipe.time()
        pipe.mget([keys.replica(o) for o in owners])
        for st in streams:
            pipe.xinfo_groups(st)
        (sec, usec), beats, *groups = pipe.execute(raise_on_error=False)
        now_ms = sec * 1000 + usec // 1000
        taken: list[tuple[str, str, dict]] = []
        for st, beat, info in zip(streams, beats, groups):
            if isinstance(info, Exception) or len(taken) >= cap:
                continue
            group = next((g for g in info if g.get("name") == keys.group), None)
            if group is None or group.get("lag") == 0:
                continue  # nothing undelivered there (lag: Redis 7+; None on older servers: look anyway)
            serving = _accepting(beat)
            if serving:
                oldest = s.redis.xrange(st, f"({group['last-delivered-id']}", "+", count=1)
                if not oldest or now_ms - int(oldest[0][0].split("-")[0]) < s.cfg.steal_after_s * 1000:
                    continue
            taken += self._read({st: ">"}, 1 if serving else cap - len(taken), None)
        return taken

    def _ack_deleted(self, stream: str) -> None:
        """Acknowledge our pending entries whose stream entry no longer exists (someone XDEL'd or trimmed it)."""
        s = self.s
        for p in s.redis.xpending_range(stream, s.keys.group, min="-", max="+", count=256,
                                        consumername=s.cfg.name):
            if not s.redis.xrange(stream, p["message_id"], p["message_id"]):
                s.redis.xack(stream, s.keys.group, p["message_id"])

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

    def accept(self, entry_id: str, fields: dict | None, stream: str | None = None) -> None:
        s = self.s
        stream = stream or s.keys.stream
        fields = fields or {}
        rid = fields.get("id")
        if rid is None or "data" not in fields:  # nothing to answer to: drop it
            log.warning("dropping malformed stream entry %s", entry_id)
            s.redis.xack(stream, s.keys.group, entry_id)
            s.redis.xdel(stream, entry_id)
            return
        if rid in s.jobs:
            return  # ours already (claimed back after a stall)
        now = time.time()
        try:
            request = self._validate(rid, fields)
        except Refused as e:
            job = Job(GenerationRequest(request_id=_safe_id(rid, entry_id), prompt="", client_id=e.client_id),
                      entry_id, 1, now, stream)
            s.end(job, error_event(job, e.code, e.message))
            return
        # Registered before the cancel mark is read: a cancel published from here on finds the job (control
        # thread), and one published earlier left its mark, which the pipeline below reads.
        job = Job(request, entry_id, 0, now, stream)
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
            s.redis.xack(stream, s.keys.group, entry_id)
            s.redis.xdel(stream, entry_id)
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
        if (handle := fields.get("kvx")) is not None:  # prefilled elsewhere: take its blocks (engine_loop imports)
            self._receive(job, handle, fields.get("from", ""))
        elif s.cfg.role == "prefill" and request.params.prompt_logprobs is None:
            job.prefill_only = True  # (prompt log-probs are scored during a prefill: those run here whole)
        s.commands.put(Add(job))

    def _receive(self, job: Job, handle: str, sender: str) -> None:
        """The blocks a prefill replica handed over, off the engine thread. Gone (expired, or taken by a decode
        replica that died since): the prompt is computed here again."""
        job.handover = {"from": sender, "blocks": 0, "bytes": 0, "imported_tokens": 0}
        got = self.s.kv_connector.receive(handle) if self.s.kv_connector is not None else None
        if got is not None:
            job.kv, sent_at = got
            job.handover.update(blocks=len(job.kv.hashes), bytes=job.kv.num_bytes,
                                transfer_ms=round(max(0.0, time.time() - sent_at) * 1000, 2))

    def _dead_letter(self, entry_id: str, fields: dict, attempts: int) -> None:
        s = self.s
        s.redis.xadd(s.keys.dead_letter, {**fields, "entry": entry_id, "attempts": str(attempts),
                                          "replica": s.cfg.name}, maxlen=10_000, approximate=True)
        log.error("request %s moved to the dead-letter stream after %d attempts", fields.get("id"), attempts)


def _accepting(heartbeat: str | None) -> bool:
    """Whether a replica's heartbeat says it is alive and pulling (not draining)."""
    try:
        return heartbeat is not None and json.loads(heartbeat).get("accepting", True)
    except ValueError:
        return False


def _safe_id(rid: str, entry_id: str) -> str:
    return rid if re.fullmatch(REQUEST_ID_PATTERN, rid) else f"invalid-{entry_id}"
