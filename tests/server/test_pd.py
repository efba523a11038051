"""Prefill/decode disaggregation on real replica processes: a prefill replica computes the prompt and hands its KV
blocks through Redis to a decode replica, whose output equals the colocated one; lost transfers and dead replicas
end in a recompute, exactly once, with nothing left behind."""
import asyncio
import signal
from collections import Counter

import redis.asyncio as aioredis

from engine_service.bench.common import scrape_metrics
from engine_service.engine.sampling_params import SamplingParams
from shared.client import EngineClient
from shared.protocol import PROTOCOL_VERSION, DoneEvent, GenerationRequest, SamplingOptions, decode_event, encode
from tests.helpers import GREEDY, Completions, random_prompt, run, wait_until

MODES = {
    "greedy": dict(max_tokens=12, **GREEDY),
    "sample": dict(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, n=2, ignore_eos=True),
    "beam": dict(max_tokens=8, mode="beam", beam_width=3, n=2, temperature=0, ignore_eos=True),
    "speculative": dict(max_tokens=12, mode="speculative", proposer="ngram", **GREEDY),
    "structured": dict(max_tokens=12, temperature=0, structured_outputs={"choice": ["yes", "no", "maybe"]}),
}


def _pd(spawn_replica, **kw):
    p = spawn_replica("P", "--role", "prefill", **kw)
    d = spawn_replica("D", "--role", "decode", **kw)
    return p.wait_ready(), d.wait_ready()


async def _last(client: EngineClient, sub):
    return [ev async for ev in client.stream(sub, 90)][-1]


def test_every_mode_through_the_hand_over_equals_the_colocated_output(spawn_replica, redis_server, keys,
                                                                        sync_redis, reference_engine):
    # heartbeats live 3 beats: 1.1 s at the default 1.5 s claim-idle, which a replica starved by the other's start-up
    # missed once in a full run (all five routed to D); this test reclaims nothing, so 3 s. (/ready now follows a
    # replica's first heartbeat: Replica.start writes it)
    p, d = _pd(spawn_replica, claim_idle=4.0)
    prompts = {m: random_prompt(50, seed=i) for i, m in enumerate(MODES)}  # 3 full blocks and a tail

    async def main():
        client = EngineClient(aioredis.Redis.from_url(redis_server.url, decode_responses=True), keys)
        subs = {m: await client.submit(GenerationRequest(prompt=prompts[m], params=SamplingOptions(**MODES[m])))
                for m in MODES}
        assert {s.route.replica for s in subs.values()} == {"P"}  # new requests start on the prefill side
        dones = {m: await _last(client, s) for m, s in subs.items()}
        await client.close()
        return dones

    dones = run(main(), 120)
    for mode, done in dones.items():
        assert isinstance(done, DoneEvent), (mode, done)
        want = reference_engine.generate([{"prompt_token_ids": prompts[mode]}], _params(MODES[mode]))[0]
        assert [o.token_ids for o in done.outputs] == [o.token_ids for o in want.outputs], mode
        h = done.metrics.handover
        assert done.metrics.replica == "D" and h["from"] == "P", (mode, done.metrics)
        assert h["blocks"] == 3 and h["imported_tokens"] == 48 and h["bytes"] > 0 and h["transfer_ms"] >= 0
        assert done.metrics.cached_prompt_tokens == 48 and done.attempt == 1  # one run, as clients see it
    # nothing left behind: no transfer keys, no entries, every block of both replicas free again
    assert not sync_redis.keys(keys.kv_transfer("*"))
    for stream in sync_redis.smembers(keys.streams):
        assert sync_redis.xlen(stream) == 0 and sync_redis.xpending(stream, keys.group)["pending"] == 0
    for replica in (p, d):
        wait_until(lambda r=replica: scrape_metrics(r.url).get("decodelab_kv_blocks[used]") == 0, 10,
                   what=f"{replica.name}'s blocks all free")


def _params(options: dict) -> SamplingParams:
    """The engine's params for a request's options, as the replica builds them."""
    return SamplingParams(**SamplingOptions(**options).model_dump())


def test_an_expired_transfer_is_computed_again_by_the_decode_replica(spawn_replica, redis_server, keys, sync_redis,
                                                                      reference_engine):
    _, d = _pd(spawn_replica)
    prompt = random_prompt(40, seed=21)
    request = GenerationRequest(prompt=prompt, params=SamplingOptions(max_tokens=6, **GREEDY))
    want = reference_engine.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, **GREEDY))[0]

    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        client = EngineClient(r, keys, route=False)
        sub = await client.subscriber.subscribe(keys.events(request.request_id))
        # what a prefill replica's hand-over leaves, with a transfer that expired before the decode side came
        await r.xadd(keys.replica_stream("D"), {"v": PROTOCOL_VERSION, "id": request.request_id,
                                                "data": encode(request), "kvx": keys.kv_transfer("gone"),
                                                "from": "P"})
        while True:
            ev = decode_event(await asyncio.wait_for(sub.get(), 30))
            if isinstance(ev, DoneEvent):
                break
        await client.close()
        return ev

    done = run(main(), 60)
    assert not sync_redis.keys(keys.kv_transfer("*")) and sync_redis.xlen(keys.replica_stream("D")) == 0
    assert done.outputs[0].token_ids == want.outputs[0].token_ids
    assert done.metrics.handover["imported_tokens"] == 0 and done.metrics.cached_prompt_tokens == 0


def test_a_killed_decode_replica_hands_its_requests_on_exactly_once(spawn_replica, redis_server, keys, sync_redis,
                                                                    reference_engine):
    p, d = _pd(spawn_replica)
    prompts = [random_prompt(40, seed=30 + i) for i in range(3)]
    max_tokens = 300
    want = [o.outputs[0].token_ids for o in reference_engine.generate(
        [{"prompt_token_ids": x} for x in prompts], SamplingParams(max_tokens=max_tokens, **GREEDY))]

    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        async with Completions(r, keys) as watch:
            client = EngineClient(r, keys, recover_after=1.0)
            subs = [await client.submit(GenerationRequest(prompt=x, params=SamplingOptions(
                max_tokens=max_tokens, **GREEDY))) for x in prompts]
            await asyncio.wait_for(watch.seen.wait(), 30)  # only the decode side streams: it is decoding
            d.kill(signal.SIGKILL)  # its entries are claimed by the prefill replica, which runs them whole
            results = await asyncio.gather(*(_last(client, s) for s in subs))
        await client.close()
        return results, watch.dones

    results, dones = run(main(), 150)
    # nothing leaked by the fault: no transfer key, no queued entry, every block of the survivor free again
    assert not sync_redis.keys(keys.kv_transfer("*"))
    assert all(sync_redis.xlen(stream) == 0 for stream in sync_redis.smembers(keys.streams))
    wait_until(lambda: scrape_metrics(p.url).get("decodelab_kv_blocks[used]") == 0, 10, what="P's blocks all free")
    assert [x.outputs[0].token_ids for x in results] == want
    assert all(x.metrics.replica == "P" for x in results)
    assert dones == Counter({x.request_id: 1 for x in results})
    assert all(x.metrics.handover["from"] == "P" for x in results)  # re-runs of handed-over entries
