"""One pub/sub connection per process for every request's event channel.

A connection per streaming request (what redis-py's `pubsub()` per call gives) runs the pool dry at ~100
concurrent streams. Here one reader task owns one connection from the client's pool: `subscribe(channel)` sends
SUBSCRIBE on it and waits for Redis to confirm (so no event published after that is missed), then events are routed
by channel into that request's asyncio queue, as raw bytes. When the connection breaks, the reader reconnects,
subscribes every channel again and puts RECONNECTED into each queue: events may have been lost meanwhile, and the
stream repairs itself from the result key.

redis-py opens the connection (URL, TLS, AUTH, the protocol handshake) and sends the commands; the replies are read
here, straight off its stream with hiredis: redis-py's own read path (`PubSub.get_message`: its timeout, retry and
push-handler layers) cost ~100 us of CPU a message against ~50 this way on the 2-core target (a micro-benchmark),
and every streamed token is one message on a core the engine's threads want.
"""
from __future__ import annotations

import asyncio
import logging
import time

import hiredis
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

log = logging.getLogger("decodelab.subscriber")

RECONNECTED = object()  # queue marker: the connection was re-made; events may be missing
PING_EVERY_S = 30.0  # a quiet connection says PING this often (what redis-py's health checks did: idle proxies)


class Subscriber:
    def __init__(self, redis: aioredis.Redis, confirm_timeout: float = 5.0):
        self.redis = redis
        self.confirm_timeout = confirm_timeout
        self._queues: dict[str, asyncio.Queue] = {}
        self._waiting: dict[str, asyncio.Future] = {}  # channel -> SUBSCRIBE confirmation
        self._conn = None  # the pub/sub connection (a redis-py connection from the client's pool)
        self._stream: asyncio.StreamReader | None = None  # its bytes, read here
        self._parser: hiredis.Reader | None = None
        self._heard = 0.0  # when the connection last brought data
        self._pinger: asyncio.TimerHandle | None = None  # _keep_alive's next turn
        self._ping: asyncio.Future | None = None
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
            if (conn := self._conn) is None:
                raise RedisConnectionError("pub/sub connection lost while subscribing")
            await conn.send_command("SUBSCRIBE", channel, check_health=False)  # (a health check would read a reply)
            await asyncio.wait_for(asyncio.shield(confirmed), self.confirm_timeout)
        except BaseException:
            await self.unsubscribe(channel)
            raise
        return queue

    async def unsubscribe(self, channel: str) -> None:
        self._waiting.pop(channel, None)
        if self._queues.pop(channel, None) is None or (conn := self._conn) is None:
            return
        try:
            await conn.send_command("UNSUBSCRIBE", channel, check_health=False)
        except (RedisError, OSError):
            pass  # a broken connection drops its subscriptions; the reconnect subscribes only live channels

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._run(), name="redis-subscriber")

    async def _connect(self) -> None:
        conn = await self.redis.connection_pool.get_connection()
        try:
            stream = getattr(conn, "_reader", None)  # (redis-py's asyncio connections have kept it there since 4.2)
            if not isinstance(stream, asyncio.StreamReader):
                raise RuntimeError(f"redis-py {redis.__version__}: its asyncio connection has no StreamReader to "
                                   "read pub/sub replies from (shared/subscriber.py needs updating)")
            if self._queues:  # every channel, those still waiting for their confirmation too (a repeat is harmless)
                await conn.send_command("SUBSCRIBE", *self._queues, check_health=False)
        except BaseException:
            await self._release(conn)
            raise
        self._conn, self._stream, self._parser = conn, stream, hiredis.Reader()
        self._heard = time.monotonic()
        self._pinger = asyncio.get_running_loop().call_later(PING_EVERY_S, self._keep_alive)
        self._connected.set()

    async def _run(self) -> None:
        """Read and route until closed; with no channel left for a second, close the connection and stop (the next
        subscribe starts a new reader), so an idle client holds no connection and leaves no task behind."""
        delay, first, idle_since = 0.05, True, None
        while not self._closed:
            try:
                if self._conn is None:
                    await self._connect()
                    if not first:
                        self.reconnects += 1
                        for queue in list(self._queues.values()):
                            queue.put_nowait(RECONNECTED)
                    first, delay = False, 0.05
                await self._read()
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

    async def _read(self) -> None:
        """Route what arrives. With channels the read waits as long as it takes (an UNSUBSCRIBE's reply wakes it:
        a timeout on every read was ~20 us a message); with none, a quarter of a second, for the idle close."""
        if self._queues:
            data = await self._stream.read(65536)
        else:
            try:
                async with asyncio.timeout(0.25):
                    data = await self._stream.read(65536)
            except TimeoutError:  # (a cancelled read leaves what arrived in the stream's buffer)
                return
        if not data:
            raise RedisConnectionError("pub/sub connection closed by the server")
        self._heard = time.monotonic()
        self._parser.feed(data)
        while (reply := self._parser.gets()) is not False:  # (a protocol error raises: the connection is re-made)
            self._route(reply)

    def _keep_alive(self) -> None:
        """Every PING_EVERY_S on a connection: a PING if it has been quiet that long (a proxy or NAT drops idle
        connections; its reply, or the error if the connection broke, reaches the reader)."""
        conn = self._conn
        if conn is None:
            return
        if time.monotonic() - self._heard >= PING_EVERY_S:
            self._ping = asyncio.ensure_future(self._send_ping(conn))
        self._pinger = asyncio.get_running_loop().call_later(PING_EVERY_S, self._keep_alive)

    @staticmethod
    async def _send_ping(conn) -> None:
        try:
            await conn.send_command("PING", check_health=False)
        except (RedisError, OSError):
            pass  # the reader sees the broken connection and re-makes it

    def _route(self, reply) -> None:
        """One reply: ["subscribe", channel, count], ["message", channel, data], ["unsubscribe", ...] or a pong
        (RESP2 arrays and RESP3 pushes parse alike)."""
        if isinstance(reply, hiredis.ReplyError):
            raise RedisConnectionError(f"pub/sub: Redis replied {reply}")
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind, channel = reply[0], reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
        if kind == b"subscribe":
            fut = self._waiting.pop(channel, None)
            if fut is not None and not fut.done():
                fut.set_result(True)
        elif kind == b"message" and (queue := self._queues.get(channel)) is not None:
            queue.put_nowait(reply[2])

    async def _drop_connection(self) -> None:
        conn, self._conn, self._stream, self._parser = self._conn, None, None, None
        if self._pinger is not None:
            self._pinger.cancel()
            self._pinger = None
        if conn is not None:
            await self._release(conn)

    async def _release(self, conn) -> None:
        """Closed (no subscriptions go back to the pool), then returned: the pool connects it again when lent."""
        try:
            await conn.disconnect(nowait=True)  # (not waiting for the close: a cancelled reader may hold the stream)
        except (RedisError, OSError):
            pass
        await self.redis.connection_pool.release(conn)

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
