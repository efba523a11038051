"""Many concurrent streams through one client: one pub/sub connection and a bounded pool, no refusals."""
import asyncio

from shared.client import EngineClient, connect
from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions

from .conftest import run

GREEDY = dict(temperature=0, ignore_eos=True)


def test_300_concurrent_streams_share_one_pubsub_connection_and_a_bounded_pool(worker, redis_server, keys,
                                                                                sync_redis):
    pool_size = 8
    seen: list[int] = []

    async def go():
        client = EngineClient(connect(redis_server.url, max_connections=pool_size, client_name="conn-test"), keys,
                              max_queue=1000)

        async def one(i: int):
            sub = await client.submit(GenerationRequest(prompt=f"stream {i}",
                                                        params=SamplingOptions(max_tokens=3, **GREEDY)))
            events = [ev async for ev in client.stream(sub, 120)]
            return events[-1]

        async def watch():
            while True:
                clients = await asyncio.to_thread(sync_redis.client_list)
                seen.append(sum(c.get("name") == "conn-test" for c in clients))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            results = await asyncio.gather(*(one(i) for i in range(300)))
        finally:
            watcher.cancel()
            await client.close()
        return results

    results = run(go())
    assert all(isinstance(ev, DoneEvent) and len(ev.outputs[0].token_ids) == 3 for ev in results), \
        [ev for ev in results if not isinstance(ev, DoneEvent)][:3]
    assert 1 < max(seen) <= pool_size, seen  # the pub/sub connection comes from the same bounded pool


def test_streams_survive_a_dropped_pubsub_connection(worker, redis_server, keys, sync_redis):
    async def go():
        client = EngineClient(redis_server.url, keys, recover_after=0.5)
        try:
            sub = await client.submit(GenerationRequest(prompt="survive", params=SamplingOptions(max_tokens=40,
                                                                                                 **GREEDY)))
            killed = 0
            async for ev in client.stream(sub, 60):
                if not killed:  # kill every pub/sub connection mid-stream: the subscriber must reconnect
                    for c in await asyncio.to_thread(sync_redis.client_list):
                        if int(c.get("sub", 0)) > 0:
                            killed += await asyncio.to_thread(sync_redis.client_kill_filter, _id=c["id"])
                if isinstance(ev, DoneEvent):
                    return ev, killed, client.subscriber.reconnects
        finally:
            await client.close()

    done, killed, reconnects = run(go())
    assert killed >= 1 and reconnects >= 1
    assert isinstance(done, DoneEvent) and len(done.outputs[0].token_ids) == 40
