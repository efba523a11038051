"""Fault injection: kill -9 during prefill, a subscriber that vanishes, a slow subscriber that Redis disconnects.

(kill -9 during decode: test_replicas.py.) In each case nothing is lost, nothing is delivered twice, nothing hangs.
"""
import asyncio
import signal
import time
from collections import Counter

import redis.asyncio as aioredis

from engine_service.engine.sampling_params import SamplingParams
from engine_service.server.redis_server import RedisServer
from shared.client import EngineClient
from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions, TokenEvent, decode_event
from tests.helpers import GREEDY, run, wait_until


async def _watch(r: aioredis.Redis, keys, seen: Counter) -> None:
    """Count every event on every request channel by (type, attempt)."""
    ps = r.pubsub()
    await ps.psubscribe(keys.events("*"))
    try:
        while True:
            msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if msg:
                ev = decode_event(msg["data"])
                seen[(ev.type, ev.attempt)] += 1
            await asyncio.sleep(0)
    finally:
        await ps.aclose()


async def _terminal(client: EngineClient, sub, timeout: float = 60):
    async for ev in client.stream(sub, timeout):
        if not isinstance(ev, TokenEvent):
            return ev


def test_kill_9_during_prefill_reruns_the_request_on_the_other_replica_exactly_once(
        spawn_replica, redis_server, keys, reference_engine):
    prompt = [3 + (i * 7) % 500 for i in range(1800)]  # 113 chunks of 16 tokens: a prefill that takes a while
    want = reference_engine.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, **GREEDY))
    replicas = {name: spawn_replica(name, "--max-num-batched-tokens", "16") for name in ("A", "B")}
    for replica in replicas.values():
        replica.wait_ready()

    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        seen = Counter()
        watcher = asyncio.create_task(_watch(r, keys, seen))
        await asyncio.sleep(0.2)  # subscribed
        client = EngineClient(r, keys, recover_after=1.0)
        sub = await client.submit(GenerationRequest(prompt=prompt, params=SamplingOptions(max_tokens=8, **GREEDY)))
        end = time.monotonic() + 20
        while not (owner := await r.get(keys.owner(sub.request_id))) and time.monotonic() < end:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.03)  # into the prefill
        replicas[owner].kill(signal.SIGKILL)
        await asyncio.sleep(0.3)  # whatever it published has arrived
        first_run = dict(seen)
        done = await _terminal(client, sub)
        await asyncio.sleep(0.5)  # a late duplicate would show up now
        watcher.cancel()
        stored = decode_event(await r.get(keys.result(sub.request_id)))
        await client.close()
        return owner, first_run, done, stored, seen

    owner, first_run, done, stored, seen = run(main(), 90)
    assert first_run == {}, f"replica {owner} was past its prefill when killed: {first_run}"
    assert isinstance(done, DoneEvent) and done == stored
    assert done.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert done.attempt == 2 and done.metrics.replica == ({"A", "B"} - {owner}).pop()
    assert seen[("done", 2)] == 1 and sum(n for (kind, _), n in seen.items() if kind == "done") == 1


def test_a_subscriber_that_vanishes_mid_stream_leaves_one_complete_result(worker, engine, redis_server, keys,
                                                                        reference_engine, sync_redis):
    want = reference_engine.generate(["Gone"], SamplingParams(max_tokens=200, **GREEDY))[0].outputs[0].text

    async def main():
        watch = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        seen = Counter()
        watcher = asyncio.create_task(_watch(watch, keys, seen))
        await asyncio.sleep(0.2)
        c = EngineClient(aioredis.Redis.from_url(redis_server.url, decode_responses=True), keys)
        sub = await c.submit(GenerationRequest(prompt="Gone", params=SamplingOptions(max_tokens=200, **GREEDY)))
        events = c.stream(sub, 30)
        assert isinstance(await anext(events), TokenEvent)
        await events.aclose()  # unsubscribes,
        await c.close()  # and the connection goes, without a cancel
        result = await asyncio.to_thread(wait_until, lambda: sync_redis.get(keys.result(sub.request_id)), 30, 0.02,
                                         "the result")
        later = EngineClient(aioredis.Redis.from_url(redis_server.url, decode_responses=True), keys)
        again = await later.result(sub.request_id)
        await later.close()
        await asyncio.sleep(0.3)
        watcher.cancel()
        await watch.aclose()
        return decode_event(result), again, seen

    done, again, seen = run(main())
    assert isinstance(done, DoneEvent) and done.text == want and done.finish_reason == "length" and again == done
    assert seen[("done", 1)] == 1
    wait_until(lambda: not worker.jobs and not engine.has_unfinished() and sync_redis.xlen(keys.stream) == 0, 5,
               what="the replica idle and the entry acknowledged")


def test_a_slow_subscriber_that_redis_disconnects_gets_each_token_once_and_the_full_text(make_worker, keys,
                                                                                        reference_engine):
    want = reference_engine.generate(["Slow reader"], SamplingParams(max_tokens=150, **GREEDY))[0].outputs[0].text
    server = RedisServer().start()  # a private server: CLIENT KILL touches nobody else
    try:
        make_worker(server.url)

        async def main():
            slow = aioredis.Redis.from_url(server.url, decode_responses=True, client_name="slow-reader")
            admin = aioredis.Redis.from_url(server.url, decode_responses=True)
            c = EngineClient(slow, keys, recover_after=0.5)
            sub = await c.submit(GenerationRequest(prompt="Slow reader", params=SamplingOptions(
                max_tokens=150, **GREEDY)))
            seqs, shown, terminals, killed = [], "", [], 0
            async for ev in c.stream(sub, 60):
                if isinstance(ev, TokenEvent):
                    seqs.append(ev.seq)
                    shown += ev.text_delta
                    if len(seqs) == 5:  # what Redis does to a subscriber past its output buffer limit
                        for conn in await admin.client_list(_type="pubsub"):
                            if conn["name"] == "slow-reader":
                                killed += await admin.client_kill_filter(_id=conn["id"])
                    await asyncio.sleep(0.01)  # a slow reader
                else:
                    terminals.append(ev)
            await c.close()
            await admin.aclose()
            return seqs, shown, terminals, killed

        seqs, shown, terminals, killed = run(main(), 90)
    finally:
        server.close()
    assert killed == 1
    assert len(terminals) == 1 and isinstance(terminals[0], DoneEvent) and terminals[0].text == want
    assert seqs == sorted(set(seqs)) and len(seqs) >= 5  # no token twice, in order
    assert want.startswith(shown)  # what the reader showed before the gap is the start of the final text


def test_a_replica_dead_between_its_final_event_and_the_ack_is_not_run_twice(make_worker, engine, redis_server,
                                                                                keys, sync_redis):
    """Our finish (result SET NX + PUBLISH + XACK) is one Lua script, so kill -9 lands before it (the request is
    re-run: test_replicas.py, the prefill test above) or after it (nothing left). Here we build the state that
    a death between the two would leave: the result stored and published, the entry still pending on a dead
    consumer. The replica that claims it must ACK it without running it again or publishing a second result."""
    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        seen = Counter()
        watcher = asyncio.create_task(_watch(r, keys, seen))
        await asyncio.sleep(0.2)
        client = EngineClient(r, keys)
        sub = await client.submit(GenerationRequest(prompt="finished once", params=SamplingOptions(max_tokens=4,
                                                                                                   **GREEDY)))
        await r.xreadgroup(keys.group, "ghost", {keys.stream: ">"}, count=1)  # the replica that will "die"
        done = DoneEvent(request_id=sub.request_id, seq=0, finish_reason="length", text="abcd", outputs=[])
        await r.set(keys.result(sub.request_id), done.model_dump_json(), ex=60)
        await r.publish(keys.events(sub.request_id), done.model_dump_json())  # its final event... and no ACK
        got = await _terminal(client, sub, 10)
        steps_before = engine.num_steps
        make_worker(claim_idle_s=0.5)  # a live replica claims the idle entry
        await asyncio.to_thread(wait_until, lambda: sync_redis.xpending(keys.stream, keys.group)["pending"] == 0,
                                10, 0.02, "the orphan entry acknowledged")
        await asyncio.sleep(0.5)  # a second completion would show up now
        watcher.cancel()
        await client.close()
        return got, done, seen, engine.num_steps - steps_before

    got, done, seen, steps = run(main())
    assert got == done and steps == 0  # delivered once, never re-run
    assert seen == Counter({("done", 1): 1})
    assert sync_redis.xlen(keys.stream) == 0
