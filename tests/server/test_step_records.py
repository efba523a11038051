"""A replica's engine steps in Redis (the playground's roofline): one record per step on a capped stream, read back
with shared.monitor.steps, and the measured roofs on its heartbeat."""
import asyncio
import json

import redis.asyncio as aioredis

from shared import monitor
from shared.client import EngineClient
from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions

from .conftest import run, wait_until

GREEDY = dict(temperature=0, ignore_eos=True)


def _request(max_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt="The capital of France is", params=SamplingOptions(max_tokens=max_tokens, **GREEDY))


async def _generate(redis_server, keys, requests: list[GenerationRequest]) -> list[DoneEvent]:
    r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    client = EngineClient(r, keys)
    subs = [await client.submit(req) for req in requests]

    async def last(sub):
        return [ev async for ev in client.stream(sub, 30)][-1]

    done = await asyncio.gather(*(last(s) for s in subs))
    await client.close()
    return done


async def _all_steps(redis_server, keys, replica: str) -> list[monitor.StepRecord]:
    r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    out, since = [], "0-0"
    while True:  # in pages of 5: the cursor carries on where the last page ended
        page, since = await monitor.steps(r, keys, replica, since, count=5)
        if not page:
            break
        out += page
    await r.aclose()
    return out


def test_every_step_of_a_request_is_on_the_replicas_stream_in_order(worker, redis_server, keys, sync_redis):
    done = run(_generate(redis_server, keys, [_request(8), _request(8)]))
    assert all(isinstance(d, DoneEvent) for d in done)
    ours = {d.request_id for d in done}
    name = worker.state.cfg.name
    # the publisher may still be sending the last step when the results arrive
    def ours_so_far():
        steps = [s for s in run(_all_steps(redis_server, keys, name)) if ours & set(s.request_ids)]
        return steps if sum(s.decode_tokens for s in steps) >= 2 * 7 else None

    steps = wait_until(ours_so_far, 10, 0.05, "the step records")
    assert [s.step for s in steps] == sorted({s.step for s in steps})  # oldest first, each once
    # 8 tokens each: the prefill samples the first, then 7 decode steps of each (one token per sequence each)
    assert sum(s.decode_tokens for s in steps) == 2 * 7 and sum(s.prefill_tokens for s in steps) > 0
    assert steps[0].decode_tokens == 0 and steps[-1].prefill_tokens == 0
    assert all(s.flops > 0 and s.bytes > 0 and s.seconds > 0 and 1 <= s.num_seqs <= 2 for s in steps)
    assert 0 < sync_redis.pttl(keys.steps(name)) <= 600_000  # the stream goes away with its replica


def test_records_go_out_in_batches_and_all_of_them_before_the_result(worker, redis_server, keys, sync_redis,
                                                                      monkeypatch):
    """At most one batch a steps_interval_s while requests run, the rest when one finishes: a client holding its
    result finds every step of it already on the stream."""
    monkeypatch.setattr(worker.state.cfg, "steps_interval_s", 3600.0)
    key = keys.steps(worker.state.cfg.name)
    added = lambda: sync_redis.xinfo_stream(key)["entries-added"] if sync_redis.exists(key) else 0  # noqa: E731
    before = added()

    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        client = EngineClient(r, keys)
        sub = await client.submit(_request(24))
        seen_mid, events = None, []
        async for ev in client.stream(sub, 30):
            events.append(ev)
            if len(events) == 12:  # mid-request: at most the batch that went out first
                seen_mid = added() - before
        await client.close()
        return seen_mid, events[-1]

    seen_mid, done = run(main())
    assert isinstance(done, DoneEvent)
    steps = [s for s in run(_all_steps(redis_server, keys, worker.state.cfg.name)) if done.request_id in s.request_ids]
    assert sum(s.decode_tokens for s in steps) == 23  # every step, none waiting in the publisher
    assert seen_mid <= 2  # the first batch (the interval had passed) and nothing since


def test_the_stream_is_capped(worker, redis_server, keys, sync_redis, monkeypatch):
    monkeypatch.setattr("engine_service.server.publisher.STEPS_MAXLEN", 5)
    # MAXLEN ~ trims whole stream nodes only (100 entries by default): small nodes make it trim within 40 steps
    before = sync_redis.config_get("stream-node-max-entries")["stream-node-max-entries"]
    sync_redis.config_set("stream-node-max-entries", 4)
    try:
        run(_generate(redis_server, keys, [_request(40)]))
        key = keys.steps(worker.state.cfg.name)
        wait_until(lambda: sync_redis.exists(key) and sync_redis.xinfo_stream(key)["entries-added"] >= 40, 10, 0.05,
                   "40 steps added")
    finally:
        sync_redis.config_set("stream-node-max-entries", before)
    assert sync_redis.xlen(key) < 20  # about the last 5 (approximate trimming keeps up to a node more)


def test_nothing_new_leaves_the_cursor_where_it_was(worker, redis_server, keys):
    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        out = await monitor.steps(r, keys, "no-such-replica", "123-0")
        await r.aclose()
        return out

    assert run(main()) == ([], "123-0")


def test_the_heartbeat_carries_the_measured_roofs(worker, sync_redis, keys):
    raw = wait_until(lambda: sync_redis.get(keys.replica(worker.state.cfg.name)), 10, 0.05, "a heartbeat")
    roofs = json.loads(raw)["roofs"]
    assert roofs["kind"] == "float32" and roofs["flops_per_s"] > 1e9 and roofs["bytes_per_s"] > 1e9
    assert roofs == worker.state.roofs


def test_bench_aggregate_reads_the_replicas_steps_back_and_finds_its_full_batch_decode_step(worker, redis_server, keys):
    import time

    from engine_service.bench.aggregate import OurServer, replica_steps

    start = time.time()
    done = run(_generate(redis_server, keys, [_request(16), _request(16)]))
    assert all(isinstance(d, DoneEvent) for d in done)
    ours = OurServer("http://unused", redis_server.url, keys.prefix)

    def summary():
        st = replica_steps(ours.step_records(), [(start, time.time())], streams=2)
        return st if st and st["decode_steps"] >= 8 else None  # the second may join a step or two late

    st = wait_until(summary, 10, 0.05, "the step records")  # the publisher may still be sending the last ones
    assert st["decode_step_ms"] > 0 and st["steps"] > st["decode_steps"] and 0 < st["busy_share"] <= 1
    assert 0 < st["prefill_share"] < 1
