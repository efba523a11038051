"""The one pub/sub connection of a client (shared/subscriber.py) against a real Redis, over RESP2 and RESP3: every
message routed to its channel's queue in order, also when many arrive in one read; subscriptions confirmed before
`subscribe` returns; a quiet connection says PING; a connection that breaks is re-made with every channel."""
import asyncio

import pytest
import redis.asyncio as aioredis

from shared import subscriber as subscriber_mod
from shared.client import connect
from shared.subscriber import RECONNECTED, Subscriber

from .conftest import run


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def make_client(request, redis_server):
    def make(**kwargs) -> aioredis.Redis:
        return aioredis.Redis.from_url(redis_server.url, protocol=request.param, **kwargs)
    return make


async def _get(queue: asyncio.Queue, n: int, timeout: float = 5.0) -> list:
    return [await asyncio.wait_for(queue.get(), timeout) for _ in range(n)]


def test_messages_reach_their_channels_in_order_even_many_in_one_read(make_client, sync_redis):
    async def main():
        r = make_client()
        sub = Subscriber(r)
        a, b = await sub.subscribe("t:a"), await sub.subscribe("t:b")
        # one pipeline: the replies land in one or a few reads of the connection
        pipe = sync_redis.pipeline(transaction=False)
        for i in range(500):
            pipe.publish("t:a" if i % 2 else "t:b", f"m{i}")
        assert sum(pipe.execute()) == 500  # each had one subscriber: confirmed before subscribe returned
        got_a, got_b = await _get(a, 250), await _get(b, 250)
        await sub.close()
        await r.aclose()
        return got_a, got_b

    got_a, got_b = run(main())
    assert got_a == [f"m{i}".encode() for i in range(1, 500, 2)]
    assert got_b == [f"m{i}".encode() for i in range(0, 500, 2)]


def test_an_unsubscribed_channel_gets_nothing_more_and_its_connection_goes_when_idle(make_client, sync_redis):
    async def main():
        r = make_client(client_name="sub-idle")
        sub = Subscriber(r)
        queue = await sub.subscribe("t:gone")
        await sub.unsubscribe("t:gone")
        await asyncio.sleep(0.1)
        listeners = sync_redis.pubsub_numsub("t:gone")[0][1]
        await asyncio.sleep(2.0)  # no channel for over a second: the reader closes its connection and stops
        names = [c["name"] for c in sync_redis.client_list()]
        stopped = sub._reader is None
        await sub.close()
        await r.aclose()
        return listeners, queue.empty(), "sub-idle" in names, stopped

    assert run(main()) == (0, True, False, True)


def test_a_quiet_connection_says_ping_and_keeps_delivering(make_client, sync_redis, monkeypatch):
    monkeypatch.setattr(subscriber_mod, "PING_EVERY_S", 0.2)

    async def main():
        r = make_client(client_name="sub-ping")
        sub = Subscriber(r)
        queue = await sub.subscribe("t:quiet")
        await asyncio.sleep(1.0)
        (conn,) = [c for c in sync_redis.client_list() if c["name"] == "sub-ping"]
        sync_redis.publish("t:quiet", "after")
        got = await _get(queue, 1)
        await sub.close()
        await r.aclose()
        return conn["cmd"], got

    assert run(main()) == ("ping", [b"after"])


def test_a_broken_connection_is_remade_with_every_channel_and_each_queue_told(redis_server, sync_redis):
    async def main():
        r = connect(redis_server.url, client_name="sub-broken")
        sub = Subscriber(r)
        a, b = await sub.subscribe("t:x"), await sub.subscribe("t:y")
        (conn,) = [c for c in sync_redis.client_list(_type="pubsub") if c["name"] == "sub-broken"]
        sync_redis.client_kill_filter(_id=conn["id"])
        marks = [await asyncio.wait_for(a.get(), 5), await asyncio.wait_for(b.get(), 5)]
        for _ in range(100):  # until the new connection's SUBSCRIBE has been confirmed
            if sync_redis.pubsub_numsub("t:x", "t:y") == [("t:x", 1), ("t:y", 1)]:
                break
            await asyncio.sleep(0.05)
        sync_redis.publish("t:x", "x1")
        sync_redis.publish("t:y", "y1")
        got = await _get(a, 1) + await _get(b, 1)
        reconnects = sub.reconnects
        await sub.close()
        await r.aclose()
        return marks, got, reconnects

    marks, got, reconnects = run(main())
    assert marks == [RECONNECTED, RECONNECTED] and got == [b"x1", b"y1"] and reconnects == 1
