"""Load: 500 mixed requests (all four modes, prompts that share prefixes and prompts that do not) from 20
concurrent clients through Redis into two replicas whose KV pools are small enough to force preemption.

Every request completes exactly once; greedy outputs (greedy mode and speculative at temperature 0) equal
the same request run alone; after the drain each replica's free-block count is back at its idle value and
no stream entry is pending. About a minute and a half here (tiny model, one thread per replica).
"""
import asyncio
import random
from collections import Counter

import redis.asyncio as aioredis

from engine_service.bench.common import scrape_metrics
from engine_service.engine.sampling_params import SamplingParams
from shared.client import EngineClient
from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions, TokenEvent, decode_event
from tests.helpers import GREEDY, run, wait_until
from tests.hf_oracle import assert_greedy_matches

N_REQUESTS, N_CLIENTS, IN_FLIGHT = 500, 20, 4  # up to 80 requests out at once
KV_BLOCKS = 40  # 640 token slots per replica for up to 16 sequences of up to ~100 tokens (x3 for beams)
MODES = {"greedy": 4, "sample": 2, "beam": 2, "speculative": 2}


def workload(seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(4)]  # 3 full blocks each, shared
    requests = []
    for i in range(N_REQUESTS):
        mode = rng.choices(list(MODES), weights=list(MODES.values()))[0]
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
        else:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 70))]
        common = dict(max_tokens=rng.randint(4, 24), ignore_eos=True)
        params = {
            "greedy": dict(temperature=0),
            "sample": dict(temperature=0.9, top_p=0.9, seed=i, n=rng.choice([1, 2])),
            "beam": dict(mode="beam", beam_width=3, temperature=0),
            "speculative": dict(mode="speculative", proposer="ngram", num_speculative_tokens=3, temperature=0),
        }[mode]
        requests.append(GenerationRequest(request_id=f"load-{i}-{mode}", prompt=prompt,
                                          params=SamplingOptions(**common, **params), client_id=f"c{i % N_CLIENTS}"))
    return requests


def test_500_mixed_requests_through_two_small_replicas_complete_exactly_once_and_leave_nothing_behind(
        spawn_replica, redis_server, keys, reference_engine, tiny_llama_dir):
    requests = workload()
    replicas = [spawn_replica(name, "--num-kv-blocks", str(KV_BLOCKS), "--max-num-seqs", "16",
                              "--expected-tokens", "16", "--max-queue", "1000", claim_idle=30) for name in "AB"]
    for replica in replicas:
        replica.wait_ready()
    idle = {r.name: scrape_metrics(r.url)["decodelab_kv_blocks[free]"] for r in replicas}
    assert all(v == KV_BLOCKS for v in idle.values()), idle

    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        dones, errors = Counter(), Counter()

        async def watch(ps):  # every terminal event published on any request channel
            while True:
                msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.2)
                if msg and '"type":"token"' not in msg["data"]:
                    ev = decode_event(msg["data"])
                    (dones if isinstance(ev, DoneEvent) else errors)[ev.request_id] += 1

        ps = r.pubsub()
        await ps.psubscribe(keys.events("*"))
        watcher = asyncio.create_task(watch(ps))
        terminals: dict[str, list] = {}

        async def one(client: EngineClient, req: GenerationRequest):
            sub = await client.submit(req)
            got = terminals.setdefault(req.request_id, [])
            async for ev in client.stream(sub, timeout=240):
                if not isinstance(ev, TokenEvent):
                    got.append(ev)

        async def client_loop(c: int):  # one client, its own connections: its share, IN_FLIGHT at a time
            client = EngineClient(redis_server.url, keys, max_queue=1000)
            mine = [q for q in requests if q.client_id == f"c{c}"]
            gate = asyncio.Semaphore(IN_FLIGHT)

            async def gated(q):
                async with gate:
                    await one(client, q)
            try:
                await asyncio.gather(*(gated(q) for q in mine))
            finally:
                await client.close()

        await asyncio.gather(*(client_loop(c) for c in range(N_CLIENTS)))
        await asyncio.sleep(0.5)  # a late duplicate would arrive now
        watcher.cancel()
        stored = {q.request_id: await r.get(keys.result(q.request_id)) for q in requests}
        pending = (await r.xpending(keys.stream, keys.group))["pending"]
        await ps.aclose()
        await r.aclose()
        return terminals, stored, dones, errors, pending

    terminals, stored, dones, errors, pending = run(main(), 300)

    # exactly once: one terminal event per client stream, one completion published, the stored result
    assert not errors, errors
    for q in requests:
        got = terminals[q.request_id]
        assert len(got) == 1 and isinstance(got[0], DoneEvent), (q.request_id, got)
        assert dones[q.request_id] == 1, (q.request_id, dones[q.request_id])
        assert decode_event(stored[q.request_id]) == got[0]
        assert all(len(o.token_ids) == q.params.max_tokens for o in got[0].outputs), q.request_id
    assert pending == 0

    # greedy (and lossless speculative) outputs equal the same request run alone
    greedy = [q for q in requests if q.params.temperature == 0 and q.params.mode != "beam"]
    assert len(greedy) > 250
    for q in greedy:
        alone = reference_engine.generate([{"prompt_token_ids": q.prompt}], SamplingParams(
            max_tokens=q.params.max_tokens, **GREEDY))[0].outputs[0].token_ids
        assert_greedy_matches(tiny_llama_dir, q.prompt, terminals[q.request_id][0].outputs[0].token_ids, alone)

    # the load was real: both replicas served, preempted, hit the prefix cache, batched
    served = Counter(terminals[q.request_id][0].metrics.replica for q in requests)
    assert set(served) == {"A", "B"}, served
    after = {r.name: scrape_metrics(r.url) for r in replicas}
    assert all(m["decodelab_preemptions_total"] > 0 for m in after.values()), after
    assert all(m["decodelab_prefix_cache_hits_total"] > 0 for m in after.values())
    assert all(m["decodelab_batch_size_sum"] / m["decodelab_batch_size_count"] > 2 for m in after.values())

    # drained: every block back (free again, cached ones included), nothing left running
    for replica in replicas:
        wait_until(lambda r=replica: scrape_metrics(r.url)["decodelab_kv_blocks[free]"] == idle[r.name], 5,
                   what=f"replica {replica.name} free blocks back to idle")
        m = scrape_metrics(replica.url)
        assert m["decodelab_kv_blocks[used]"] == 0 and m["decodelab_replica_requests"] == 0
