"""2,000 concurrent streaming clients on one API front (`decodelab api`, its own process), two replicas, one Redis:
no errors, each request once."""
import asyncio
import random

import httpx

from engine_service.bench.common import scrape_metrics
from engine_service.bench.sweep import http_burst
from tests.replicas import Front, Replica

CLIENTS = 2000


def test_2000_concurrent_streaming_clients_complete_exactly_once(tiny_llama_dir, redis_server, keys, sync_redis):
    extra = ("--max-queue", str(2 * CLIENTS), "--max-num-seqs", "128")
    env = {"DECODELAB_MAX_PER_CLIENT": "0"}  # all 2,000 come from one address
    replicas = [Replica(tiny_llama_dir, redis_server.url, keys, f"r{i}", *extra, env=env) for i in range(2)]
    front = Front(redis_server.url, keys, "--max-queue", str(2 * CLIENTS), env=env)
    try:
        for r in [*replicas, front]:
            r.wait_ready()
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(4, 24))] for _ in range(CLIENTS)]
        result = asyncio.run(asyncio.wait_for(http_burst(front.url, "tiny", prompts, max_tokens=3), 600))
        assert result["errors"] == {} and result["ok"] == CLIENTS, result["errors"]

        # exactly once: the replicas finished 2,000 requests between them (a duplicate run would count twice)
        finished = [scrape_metrics(r.url).get('decodelab_requests_total', 0) for r in replicas]
        per_outcome = [{k: v for k, v in scrape_metrics(r.url).items() if k.startswith("decodelab_requests_total")}
                       for r in replicas]
        assert sum(finished) == CLIENTS, per_outcome
        assert all(n > 0 for n in finished), finished  # both replicas served
        for stream in sync_redis.smembers(keys.streams):  # the shared one and each replica's queue
            assert sync_redis.xlen(stream) == 0  # every entry acknowledged and deleted
            assert sync_redis.xpending(stream, keys.group)["pending"] == 0
        with httpx.Client(base_url=front.url) as http:  # the front is still healthy afterwards
            assert http.get("/ready").status_code == 200
    finally:
        for r in [*replicas, front]:
            r.kill()
