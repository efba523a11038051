"""One pub/sub connection per process for every request's event channel.

A connection per streaming request (what redis-py's `pubsub()` per call gives) runs the pool dry at ~100
concurrent streams. Here one reader task owns one PUBSUB connection: `subscribe(channel)` sends SUBSCRIBE on it
and waits for Redis to confirm (so no event published after that is missed), then events are routed by channel
into that request's asyncio queue. When the connection breaks, the reader reconnects, subscribes every channel
again and puts RECONNECTED into each queue: events may have been lost meanwhile, and the stream repairs itself
from the result key.
"""
from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

log = logging.getLogger("decodelab.subscriber")

RECONNECTED = object()  # queue marker: the connection was re-made; events may be missing


class Subscriber:
    def __init__(self, redis: aioredis.Redis, confirm_timeout: float = 5.0):
        self.redis = redis
        self.confirm_timeout = confirm_timeout
        self._queues: dict[str, asyncio.Queue] = {}
        self._waiting: dict[str, asyncio.Future] = {}  # channel -> SUBSCRIBE confirmation
        self._pubsub = None
        self._reader: asyncio.Task | None = None
        self._connected = asyncio.Event()
        self._closed = False
        self.reconnects = 0

    @property
    def channels(self) -> int:
        return len(self._queues)

    async def subscribe(self, channel: str) -> asyncio.Queue:
        """The channel's queue, once Redis has confirmed the subscription."""
        if self._closed:
            raise RuntimeError("subscriber closed")
        if channel in self._queues:
            raise ValueError(f"channel {channel!r} is already subscribed")
        queue: asyncio.Queue = asyncio.Queue()
        confirmed = asyncio.get_running_loop().create_future()
        # registered before the reader is (re)started: a reader only stops when no channel is registered
        self._queues[channel], self._waiting[channel] = queue, confirmed
        try:
            self._ensure_reader()
            await asyncio.wait_for(self._connected.wait(), self.confirm_timeout)
            if (pubsub := self._pubsub) is None:
                raise RedisConnectionError("pub/sub connection lost while subscribing")
            await pubsub.subscribe(channel)
            await asyncio.wait_for(asyncio.shield(confirmed), self.confirm_timeout)
        except BaseException:
            await self.unsubscribe(channel)
            raise
        return queue

    async def unsubscribe(self, channel: str) -> None:
        self._waiting.pop(channel, None)
        if self._queues.pop(channel, None) is None or self._pubsub is None:
            return
        try:
            await self._pubsub.unsubscribe(channel)
        except (RedisError, OSError):
            pass  # a broken connection drops its subscriptions; the reconnect subscribes only live channels

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._run(), name="redis-subscriber")

    async def _connect(self) -> None:
        self._pubsub = self.redis.pubsub()
        await self._pubsub.connect()
        if self._queues:  # every channel, those still waiting for their confirmation too (a repeat is harmless)
            await self._pubsub.subscribe(*self._queues)
        self._connected.set()

    async def _run(self) -> None:
        """Read and route until closed; with no channel left for a second, close the connection and stop (the next
        subscribe starts a new reader), so an idle client holds no connection and leaves no task behind."""
        delay, first, idle_since = 0.05, True, None
        while not self._closed:
            try:
                if self._pubsub is None:
                    await self._connect()
                    if not first:
                        self.reconnects += 1
                        for queue in list(self._queues.values()):
                            queue.put_nowait(RECONNECTED)
                    first, delay = False, 0.05
                msg = await self._pubsub.get_message(timeout=0.25)
                if msg is not None:
                    self._route(msg)
                if self._queues:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > 1.0:
                    self._connected.clear()
                    await self._drop_connection()
                    if not self._queues:  # (nobody subscribed while the connection closed)
                        self._reader = None
                        return
                    idle_since = None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis gone, a closed pool, ...: never a silent dead reader
                log.warning("pub/sub connection lost (%s: %s); reconnecting in %.2fs", type(e).__name__, e, delay)
                self._connected.clear()
                await self._drop_connection()
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)

    def _route(self, msg: dict) -> None:
        channel = msg.get("channel")
        if isinstance(channel, bytes):
            channel = channel.decode()
        if msg["type"] == "subscribe":
            fut = self._waiting.pop(channel, None)
            if fut is not None and not fut.done():
                fut.set_result(True)
        elif msg["type"] == "message" and (queue := self._queues.get(channel)) is not None:
            queue.put_nowait(msg["data"])

    async def _drop_connection(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except (RedisError, OSError):
                pass

    async def close(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, RedisError, OSError):
                pass
        await self._drop_connection()
        self._queues.clear()
