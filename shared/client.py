"""Client side of the Redis protocol: submit, stream events with gap detection, recover, cancel.

Used by the web UI and the OpenAI endpoints alike (asyncio; redis.asyncio). One client holds one bounded
connection pool (callers wait for a free connection instead of failing) with a timeout on every socket, and one
pub/sub connection for all its streams (shared/subscriber.py).
"""
from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError, ResponseError

from shared.keys import Keys
from shared.limits import Limits
from shared.protocol import (
    PROTOCOL_VERSION,
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    TerminalEvent,
    TokenEvent,
    decode_event,
    encode,
)
from shared.router import Route, Router, routing_enabled, safe_route
from shared.scripts import SUBMIT
from shared.subscriber import RECONNECTED, Subscriber


def connect(url: str, max_connections: int = 128, pool_timeout: float = 30.0, socket_timeout: float = 10.0,
            connect_timeout: float = 5.0, client_name: str | None = None) -> aioredis.Redis:
    """A Redis client whose every call is bounded: connecting, each reply, and the wait for a pooled connection.
    `client_name` names its connections in CLIENT LIST."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, decode_responses=True, max_connections=max_connections, timeout=pool_timeout,
        socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout, health_check_interval=30,
        client_name=client_name)
    return aioredis.Redis(connection_pool=pool)


class QueueFull(Exception):
    code = "queue_full"


class ClientBusy(QueueFull):
    """The client (client_id) already has `max_per_client` requests queued or running."""

    code = "too_many_requests"


def random_seed() -> int:
    return secrets.randbits(63)


def _s(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def ensure_group(r: aioredis.Redis, keys: Keys) -> None:
    try:
        await r.xgroup_create(keys.stream, keys.group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


@dataclass
class Submission:
    request: GenerationRequest
    entry_id: str
    events: asyncio.Queue  # raw event payloads from the subscriber (or RECONNECTED)
    channel: str
    subscriber: Subscriber
    stream: str  # the stream it was queued on: the shared one, or the routed replica's
    route: Route | None = None  # the router's decision (None: routing off)
    gaps: int = 0  # sequence gaps seen; after one, tokens are skipped and the result key is used
    restarts: int = 0  # times a replica re-ran the request (its first replica died)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def close(self) -> None:
        """Stop listening (the request itself runs on; see EngineClient.cancel)."""
        await self.subscriber.unsubscribe(self.channel)


@dataclass
class TextAccumulator:
    """Turns a token-event stream into append-only text per output, across restarts and rewrites.

    A re-run (higher attempt) or a beam rewrite may repeat text already delivered: only what goes
    beyond it is returned. `final` returns the rest of the final text at the end.
    """

    delivered: dict[int, str] = field(default_factory=dict)
    current: dict[int, str] = field(default_factory=dict)
    attempt: int = 0
    diverged: bool = False  # a re-run's text contradicts what was delivered: the caller must end with an error

    def _advance(self, index: int, text: str) -> str:
        self.current[index] = text
        sent = self.delivered.get(index, "")
        if not text.startswith(sent):
            # a beam rewrite within one attempt is expected (beams stream once final); across attempts it is not
            self.diverged = self.diverged or (self.attempt > 1 and not sent.startswith(text))
            return ""
        if len(text) == len(sent):
            return ""
        self.delivered[index] = text
        return text[len(sent):]

    def feed(self, ev: TokenEvent) -> str:
        if ev.attempt != self.attempt:
            self.attempt, self.current = ev.attempt, {}
        base = "" if ev.reset else self.current.get(ev.index, "")
        return self._advance(ev.index, base + ev.text_delta)

    def final(self, index: int, text: str) -> str:
        delta = self._advance(index, text)
        # the final text must extend what was delivered (a re-run that is shorter still contradicts it)
        self.diverged = self.diverged or not text.startswith(self.delivered.get(index, ""))
        return delta


class EngineClient:
    def __init__(self, redis: aioredis.Redis | str, keys: Keys | None = None, *, max_queue: int | None = None,
                 max_per_client: int | None = None, recover_after: float = 3.0, lost_after: float = 5.0,
                 timeout: float = 600.0, result_ttl: int = 3600, route: bool | None = None) -> None:
        self.redis = connect(redis) if isinstance(redis, str) else redis
        self.subscriber = Subscriber(self.redis)
        self.keys = keys or Keys.from_env()
        self.max_queue = max_queue if max_queue is not None else int(os.environ.get("DECODELAB_MAX_QUEUE", 256))
        self.max_per_client = max_per_client if max_per_client is not None else Limits.from_env().max_per_client
        self.recover_after = recover_after  # silence after which the result key is checked
        self.lost_after = lost_after  # how long a request may be unknown to Redis (no entry, no owner) before `lost`
        self.timeout = timeout  # default overall wait for one request
        self.cancel_ttl = result_ttl
        self._submit = self.redis.register_script(SUBMIT)
        self._group_ready = False
        # prefix-aware routing (shared/router.py) unless turned off (DECODELAB_ROUTING=0): the shared stream then
        self.router = Router(self.redis, self.keys) if (routing_enabled() if route is None else route) else None

    async def close(self) -> None:
        await self.subscriber.close()
        await self.redis.aclose()

    async def submit(self, request: GenerationRequest, route_key: str | None = None) -> Submission:
        """Subscribe to the request's channel, then enqueue it; raises QueueFull (or ClientBusy) beyond the bounds.

        With routing on, it is queued for the replica that holds the longest prefix of it net of load (requests
        with the same `route_key` stay together); else, or with no replica live, on the shared stream."""
        if not self._group_ready:
            await ensure_group(self.redis, self.keys)
            self._group_ready = True
        p = request.params
        if p.seed is None and p.temperature > 0 and p.mode not in ("greedy", "beam"):
            # A sampled request gets its seed here, so a re-run after a replica dies continues the same text
            request = request.model_copy(update={"params": p.model_copy(update={"seed": random_seed()})})
        route = await safe_route(self.router, request, route_key) if self.router is not None else None
        stream = route.stream if route is not None else self.keys.stream
        channel = self.keys.events(request.request_id)
        events = await self.subscriber.subscribe(channel)  # confirmed before the request exists: nothing is missed
        try:
            per_client = self.max_per_client if request.client_id else 0
            ok, value = await self._submit(
                keys=[stream, self.keys.client(request.client_id), self.keys.streams],
                args=[self.keys.group, self.max_queue, PROTOCOL_VERSION, request.request_id, encode(request),
                      per_client, int(self.timeout) + 60])
            if int(ok) == 2:
                raise ClientBusy(f"too many requests: client {request.client_id!r} has {_s(value)} queued or "
                                 f"running (limit {self.max_per_client}); retry when one has finished")
            if not int(ok):
                raise QueueFull(f"queue full: {_s(value)} requests waiting (limit {self.max_queue}); retry later")
        except BaseException:
            await self.subscriber.unsubscribe(channel)
            raise
        return Submission(request, _s(value), events, channel, self.subscriber, stream, route)

    async def result(self, request_id: str) -> TerminalEvent | None:
        data = await self.redis.get(self.keys.result(request_id))
        return decode_event(data) if data is not None else None

    async def cancel(self, request_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.cancelled(request_id), "1", ex=self.cancel_ttl)
            pipe.publish(self.keys.cancel_channel, request_id)
            await pipe.execute()

    async def _recover(self, sub: Submission) -> TerminalEvent | bool:
        """The result if there is one, else whether Redis still knows the request (queued or owned by a replica).
        One round trip: thousands of waiting streams run this every few seconds."""
        rid = sub.request_id
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.result(rid))
            pipe.exists(self.keys.owner(rid))
            pipe.xrange(sub.stream, sub.entry_id, sub.entry_id)
            pipe.get(self.keys.result(rid))  # it may have finished between the checks
            done, owned, queued, done_after = await pipe.execute()
        if (data := done or done_after) is not None:
            return decode_event(data)
        return bool(owned or queued)

    async def stream(self, sub: Submission, timeout: float | None = None
                     ) -> AsyncIterator[TokenEvent | DoneEvent | ErrorEvent]:
        """Yield the request's TokenEvents, then exactly one terminal event (DoneEvent or ErrorEvent).

        Gaps in sequence numbers and silences are repaired from the result key; every wait is bounded.
        """
        rid = sub.request_id
        end = time.monotonic() + (timeout or self.timeout)
        if sub.request.deadline is not None:  # the replica reports a missed deadline itself; this is a backstop
            end = min(end, time.monotonic() + max(0.0, sub.request.deadline - time.time()) + self.recover_after + 2)
        attempt, next_seq, gap, unreachable = 0, 0, False, False
        last_heard, missing_since = time.monotonic(), None
        try:
            while True:
                now = time.monotonic()
                if now >= end and unreachable:
                    yield ErrorEvent(request_id=rid, seq=0, attempt=max(attempt, 1), code="unavailable",
                                     message="Redis unreachable; the request's fate is unknown")
                    return
                if now >= end:  # nobody waits for it any more: stop it too
                    code = "deadline_exceeded" if sub.request.deadline is not None else "timeout"
                    try:
                        await asyncio.wait_for(self.cancel(rid), 2.0)
                    except (TimeoutError, RedisError, OSError):
                        pass
                    yield ErrorEvent(request_id=rid, seq=0, attempt=max(attempt, 1), code=code,
                                     message=f"no result for request {rid} in time")
                    return
                try:
                    if now - last_heard >= self.recover_after:
                        last_heard = now
                        known = await self._recover(sub)
                        unreachable = False
                        if not isinstance(known, bool):
                            yield known
                            return
                        # Unknown: after a Redis restart the running replica re-registers within a heartbeat.
                        missing_since = None if known else (missing_since or now)
                        if missing_since is not None and now - missing_since >= self.lost_after:
                            await self.redis.zrem(self.keys.client(sub.request.client_id), rid)  # free its slot
                            yield ErrorEvent(request_id=rid, seq=0, attempt=max(attempt, 1), code="lost",
                                             message="the request is gone from Redis with no result "
                                                     "(was Redis restarted without persistence?)")
                            return
                except (RedisError, OSError):
                    unreachable = True  # keep trying until the deadline; the subscriber reconnects meanwhile
                    await asyncio.sleep(0.1)
                    continue
                # sleep until an event, the next silence check or the deadline: thousands of waiting streams must
                # not each wake up several times a second
                wait = min(self.recover_after - (time.monotonic() - last_heard), end - time.monotonic())
                try:  # (asyncio.timeout, not wait_for: no task created per event)
                    async with asyncio.timeout(max(0.01, wait)):
                        data = await sub.events.get()
                except TimeoutError:
                    continue
                if data is RECONNECTED:  # events may have been lost while the connection was down
                    last_heard = 0.0
                    continue
                try:
                    ev = decode_event(data)
                except ValidationError:
                    continue
                if ev.request_id != rid or ev.attempt < attempt:
                    continue  # a stale replica still running an older attempt
                last_heard = time.monotonic()
                if ev.attempt > attempt:
                    sub.restarts += attempt > 0
                    attempt, next_seq, gap = ev.attempt, 0, False
                if ev.seq < next_seq:
                    continue  # duplicate (a publisher retried)
                if isinstance(ev, (DoneEvent, ErrorEvent)):
                    yield ev
                    return
                if ev.seq > next_seq and not gap:
                    gap = True
                    sub.gaps += 1
                next_seq = ev.seq + 1
                if not gap:
                    yield ev
        finally:
            await sub.close()

    async def generate(self, request: GenerationRequest, timeout: float | None = None) -> TerminalEvent:
        """Submit and wait for the terminal event (errors are returned, not raised; QueueFull is raised)."""
        sub = await self.submit(request)
        async with aclosing(self.stream(sub, timeout)) as events:
            async for ev in events:
                if not isinstance(ev, TokenEvent):
                    return ev
        raise AssertionError("stream ended without a terminal event")
