"""Failures: a replica killed with -9 mid-generation, Redis restarted mid-stream."""
import asyncio
import signal
import time
from collections import Counter

import redis
import redis.asyncio as aioredis

from engine_service.engine.sampling_params import SamplingParams
from engine_service.server.redis_server import RedisServer
from shared.client import EngineClient
from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions, TokenEvent, decode_event
from shared.routing import routing_name
from tests.helpers import GREEDY, run, wait_until


def test_kill_9_of_a_replica_mid_generation_every_request_completes_exactly_once(
        spawn_replica, redis_server, keys, reference_engine):
    prompts = [f"Replica test {i}:" for i in range(8)]
    max_tokens = 400
    want = [o.outputs[0].text for o in reference_engine.generate(prompts, SamplingParams(max_tokens=max_tokens,
                                                                                         **GREEDY))]
    a, b = spawn_replica("A"), spawn_replica("B")
    a.wait_ready(), b.wait_ready()

    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        watch = r.pubsub()
        await watch.psubscribe(keys.events("*"))
        dones, tokens_by = Counter(), {}

        async def watch_all():
            while True:
                msg = await watch.get_message(ignore_subscribe_messages=True, timeout=0.2)
                await asyncio.sleep(0)  # a busy channel would otherwise starve the other tasks
                if msg:
                    ev = decode_event(msg["data"])
                    if isinstance(ev, DoneEvent):
                        dones[ev.request_id] += 1
                    elif isinstance(ev, TokenEvent) and ev.attempt == 1:
                        tokens_by.setdefault(ev.request_id, 0)
                        tokens_by[ev.request_id] += 1

        watcher = asyncio.create_task(watch_all())
        client = EngineClient(r, keys, recover_after=1.0)
        subs = [await client.submit(GenerationRequest(prompt=p, params=SamplingOptions(max_tokens=max_tokens,
                                                                                       **GREEDY))) for p in prompts]
        streams = [asyncio.create_task(_last(client, s)) for s in subs]
        owners = {}
        patience, end = time.monotonic() + 2, time.monotonic() + 30
        while time.monotonic() < end:  # until A is mid-generation on some requests, and B on others
            names = await r.mget([keys.owner(s.request_id) for s in subs])
            owners = {s.request_id: n for s, n in zip(subs, names) if n and tokens_by.get(s.request_id, 0) >= 3}
            if "A" in owners.values() and "B" in owners.values():
                break
            if owners and time.monotonic() > patience:  # the router's ties put every request on one replica: kill
                break  # it while they run (waiting on for the other let them all finish once in a full run)
            await asyncio.sleep(0.02)
        # A, unless the router's tie-breaks (random among equal costs) left it no request mid-generation: then B
        victim = "A" if "A" in owners.values() else "B"
        killed = [rid for rid, n in owners.items() if n == victim]
        (a if victim == "A" else b).kill(signal.SIGKILL)
        results = await asyncio.gather(*streams)
        await asyncio.sleep(0.5)  # any late duplicate would show up now
        watcher.cancel()
        stored = [decode_event(await r.get(keys.result(s.request_id))) for s in subs]
        await watch.aclose()
        await client.close()
        return subs, victim, killed, results, stored, dones

    subs, victim, killed, results, stored, dones = run(main(), 90)
    assert killed, "no replica was mid-generation when one was killed"
    for sub, done, kept, expected in zip(subs, results, stored, want):
        assert isinstance(done, DoneEvent), done
        assert done.text == expected and done == kept
        assert dones[sub.request_id] == 1  # exactly one completion published
        if sub.request_id in killed:
            assert done.attempt == 2 and done.metrics.replica == ("B" if victim == "A" else "A")


async def _last(client: EngineClient, sub):
    last = None
    async for ev in client.stream(sub, 60):
        last = ev
    return last


def test_redis_restart_mid_stream_ends_cleanly_and_the_replica_reconnects(make_worker, keys):
    server = RedisServer().start()
    try:
        worker = make_worker(server.url, claim_idle_s=1.0)

        async def main():
            client = EngineClient(aioredis.Redis.from_url(server.url, decode_responses=True), keys, recover_after=0.5)
            sub = await client.submit(GenerationRequest(prompt="Long story", params=SamplingOptions(
                max_tokens=1500, **GREEDY)))
            t_kill, n, terminal = None, 0, None
            async for ev in client.stream(sub, 60):
                if isinstance(ev, TokenEvent):
                    n += 1
                    if n == 5:
                        server.stop(kill=True)
                        t_kill = time.monotonic()
                        await asyncio.sleep(0.5)
                        server.start()
                else:
                    terminal, waited = ev, time.monotonic() - t_kill
            after = await client.generate(GenerationRequest(prompt="again", params=SamplingOptions(
                max_tokens=40, **GREEDY)), timeout=30)  # new full blocks: KV events re-create the set, partly
            await client.close()
            return terminal, waited, after

        terminal, waited, after = run(main(), 90)
        # The replica survived the restart, re-registered the request and wrote its result to the new Redis.
        assert isinstance(terminal, DoneEvent), terminal
        assert terminal.finish_reason == "length" and len(terminal.outputs[0].token_ids) == 1500
        assert waited < 30
        assert isinstance(after, DoneEvent) and len(after.outputs[0].token_ids) == 40
        # routers see the replica again, with everything its cache holds (not only what it cached since)
        r = redis.Redis.from_url(server.url, decode_responses=True)
        name, bm = worker.state.cfg.name, worker.engine.block_manager
        assert r.zscore(keys.live, name)
        wait_until(lambda: r.smembers(keys.kv_blocks(name)) == {routing_name(h) for h in bm.cached}, 10, 0.1,
                   "the prefix-cache set published whole again")
        r.close()
    finally:
        server.close()
