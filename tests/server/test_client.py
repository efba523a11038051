"""The client helper against a real Redis: backpressure, gap repair, recovery, bounded waits, cancel marks.

Here the test itself plays the replica's side of the protocol with plain Redis commands.
"""
import asyncio
import time

import pytest
import redis.asyncio as aioredis

from shared.client import EngineClient, QueueFull, TextAccumulator
from shared.protocol import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent, encode
from tests.helpers import run


def _client(redis_server, keys, **kw) -> EngineClient:
    return EngineClient(aioredis.Redis.from_url(redis_server.url, decode_responses=True), keys, **kw)


def _done(rid: str, text: str, seq: int, attempt: int = 1) -> DoneEvent:
    return DoneEvent(request_id=rid, seq=seq, attempt=attempt, finish_reason="length", text=text, outputs=[
        {"index": 0, "text": text, "token_ids": [1] * len(text), "finish_reason": "length"}])


def _tok(rid: str, seq: int, text: str, attempt: int = 1) -> str:
    return encode(TokenEvent(request_id=rid, seq=seq, attempt=attempt, text_delta=text, token_ids=[seq]))


def test_submit_beyond_the_queue_bound_is_refused_at_once(redis_server, keys):
    async def main():
        c = _client(redis_server, keys, max_queue=3)
        for _ in range(3):
            await (await c.submit(GenerationRequest(prompt="x"))).close()
        with pytest.raises(QueueFull, match="limit 3"):
            await c.submit(GenerationRequest(prompt="x"))
        assert await c.redis.xlen(keys.stream) == 3
        await c.close()
    run(main(), 10)


def test_a_gap_in_sequence_numbers_is_repaired_from_the_result_key(redis_server, keys):
    async def main():
        c = _client(redis_server, keys, recover_after=0.5)
        sub = await c.submit(GenerationRequest(prompt="x"))
        rid = sub.request_id
        seen = []

        async def consume():
            async for ev in c.stream(sub, timeout=10):
                seen.append(ev)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        await c.redis.publish(keys.events(rid), _tok(rid, 0, "a"))
        await c.redis.publish(keys.events(rid), _tok(rid, 2, "c"))  # seq 1 never arrives
        await c.redis.publish(keys.events(rid), _tok(rid, 3, "d"))
        await c.redis.set(keys.result(rid), encode(_done(rid, "abcd", 4)))  # the Done message itself is lost too
        await asyncio.wait_for(task, 10)
        assert [type(e) for e in seen] == [TokenEvent, DoneEvent]  # nothing after the gap but the full result
        assert seen[-1].text == "abcd" and sub.gaps == 1
        await c.close()
    run(main(), 15)


def test_a_rerun_is_followed_and_duplicates_ignored(redis_server, keys):
    async def main():
        c = _client(redis_server, keys)
        sub = await c.submit(GenerationRequest(prompt="x"))
        rid, ch = sub.request_id, keys.events(sub.request_id)
        acc, out = TextAccumulator(), []

        async def consume():
            async for ev in c.stream(sub, timeout=10):
                out.append(acc.feed(ev) if isinstance(ev, TokenEvent) else acc.final(0, ev.text))

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        for msg in (_tok(rid, 0, "ab"), _tok(rid, 0, "ab"), _tok(rid, 1, "c"),  # replica 1 (and a duplicate)
                    _tok(rid, 0, "ab", attempt=2), _tok(rid, 1, "cd", attempt=2),  # replica 2 re-runs it
                    _tok(rid, 2, "zz"),  # the old replica is stale: ignored
                    encode(_done(rid, "abcde", 2, attempt=2))):
            await c.redis.publish(ch, msg)
        await asyncio.wait_for(task, 10)
        assert "".join(out) == "abcde" and sub.restarts == 1
        await c.close()
    run(main(), 15)


def test_a_request_that_vanished_from_redis_ends_in_a_clear_error(redis_server, keys):
    async def main():
        c = _client(redis_server, keys, recover_after=0.2, lost_after=1.0)
        sub = await c.submit(GenerationRequest(prompt="x"))
        await c.redis.delete(keys.stream)  # what a Redis restart without persistence does
        t0 = time.monotonic()
        events = [ev async for ev in c.stream(sub, timeout=10)]
        assert len(events) == 1 and isinstance(events[0], ErrorEvent) and events[0].code == "lost"
        assert 1.0 <= time.monotonic() - t0 < 3
        await c.close()
    run(main(), 15)


def test_waiting_is_bounded_by_the_timeout_and_the_deadline(redis_server, keys):
    async def main():
        c = _client(redis_server, keys, recover_after=0.2)
        sub = await c.submit(GenerationRequest(prompt="x"))  # no replica: it stays queued
        t0 = time.monotonic()
        events = [ev async for ev in c.stream(sub, timeout=0.5)]
        assert events[-1].code == "timeout" and time.monotonic() - t0 < 3
        sub = await c.submit(GenerationRequest(prompt="x", deadline=time.time() + 0.2))
        events = [ev async for ev in c.stream(sub, timeout=30)]
        assert events[-1].code == "deadline_exceeded" and time.monotonic() - t0 < 6
        await c.close()
    run(main(), 15)


def test_cancel_marks_the_request_and_notifies_replicas(redis_server, keys):
    async def main():
        c = _client(redis_server, keys)
        listener = c.redis.pubsub()
        await listener.subscribe(keys.cancel_channel)
        await c.cancel("r42")
        msg = None
        for _ in range(50):
            msg = await listener.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if msg:
                break
        assert msg and msg["data"] == "r42"
        assert await c.redis.exists(keys.cancelled("r42"))
        await listener.aclose()
        await c.close()
    run(main(), 10)
