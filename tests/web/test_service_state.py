"""What the playground reads from Redis besides the streams (queue positions, a replica that goes away), and when a
run's frames go out."""
from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio as aioredis
from gradio_client import Client

from shared import monitor
from shared.client import EngineClient
from shared.protocol import GenerationRequest
from tests.helpers import run, wait_until

from .conftest import TINY_KV_BLOCKS, WebApp, _keys


def test_queue_position_counts_the_entries_no_replica_has_taken(redis_server):
    keys = _keys("queue")

    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        client = EngineClient(r, keys)
        subs = [await client.submit(GenerationRequest(prompt="x")) for _ in range(3)]
        assert [await monitor.queue_position(r, keys, s.entry_id) for s in subs] == [1, 2, 3]
        await r.xreadgroup(keys.group, "replica-a", {keys.stream: ">"}, count=1)  # a replica takes the first
        assert [await monitor.queue_position(r, keys, s.entry_id) for s in subs] == [None, 1, 2]
        for s in subs:
            await s.close()
        await client.close()  # its subscriber task, then the Redis client it was given

    run(main(), 10)


def _in_process_replica(redis_server, tiny_llama_dir, keys, name: str, **config):
    """(engine, replica) of the tiny model in this process, not started: a test decides when it comes and goes."""
    from engine_service.engine.llm_engine import LLMEngine
    from engine_service.server.config import ReplicaConfig
    from engine_service.server.replica import Replica

    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=TINY_KV_BLOCKS, max_num_seqs=16, num_threads=1)
    return engine, Replica(engine, ReplicaConfig(redis_server.url, keys=keys, name=name, model_name="tiny", **config))


def test_a_replica_that_goes_away_mid_run_ends_the_run_with_a_message(redis_server, tiny_llama_dir):
    keys = _keys("dies")
    engine, worker = _in_process_replica(redis_server, tiny_llama_dir, keys, "doomed", claim_idle_s=2.0)
    worker.start()
    web = WebApp(redis_server.url, keys, replica_gone_s=1.0)
    try:
        sync = redis.Redis.from_url(redis_server.url)
        wait_until(lambda: sync.exists(keys.replica("doomed")), 5, what="the replica's heartbeat")
        sync.close()
        client = Client(web.url, verbose=False)
        job = client.submit(prompt="Once upon a time", chat=False, max_tokens=1000, share=False, beams_shown=1,
                            model="tiny", api_name="/run")
        wait_until(lambda: any('data-status="running"' in str(f) for f in job.outputs()), 30, what="streaming")
        worker.stop()  # heartbeats stop, nothing more is published: to Redis, the replica is gone
        result = job.result(timeout=20)
        cols = result[-1]["columns"]
        assert "engine went down" in result[0]
        sync = redis.Redis.from_url(redis_server.url)
        for col in cols.values():
            assert col["status"] == "error" and "engine went down" in col["error"], col
            assert sync.exists(keys.cancelled(col["request_id"]))  # a replica starting later will not run it
        sync.close()
    finally:
        web.close()
        for rid in list(engine.requests):
            engine.abort(rid)


def test_each_columns_first_token_is_drawn_at_once_when_the_prompt_is_shared(redis_server, tiny_stack):
    """With the prompt shared, greedy goes first and the other columns' first tokens come a step after its own,
    when a frame with a token has gone out already: each of them still cuts the pause short (a pace of 30 s here),
    so every column's first token is drawn while the run still goes on. Before, only the run's first token did:
    the others waited out the pace (min_interval in the playground; here the whole run, drawn at its end)."""
    session_run = _tiny_run(redis_server, tiny_stack[2], 300, share_prompt=True)
    drawn_running: dict[str, bool] = {}  # mode -> the run was still going when a frame first showed its token

    async def main():
        async for _ in session_run.updates(min_interval=0.01):
            session_run.pace = 30.0
            for mode, c in session_run.columns.items():
                if c.first_token_at and mode not in drawn_running:
                    drawn_running[mode] = not session_run.finished
            if len(drawn_running) == len(session_run.columns):
                session_run.stop()
                return

    run(main(), 60)
    assert drawn_running == dict.fromkeys(session_run.columns, True), (
        drawn_running, [(c.status, c.error) for c in session_run.columns.values()])


def test_a_session_over_its_request_limit_sees_too_many_requests_not_queue_full(redis_server, monkeypatch):
    from web.modes import Settings
    from web.session import Run, Service

    monkeypatch.setenv("DECODELAB_MAX_PER_CLIENT", "1")  # no replica: the first request stays queued
    session_run = Run(Service(redis_server.url, _keys("busy")), Settings(prompt="x", chat=False),
                      share_prompt=False, client_id="session-1")

    async def main():
        async for _ in session_run.updates(min_interval=0.01):
            failed = [c for c in session_run.columns.values() if c.status == "error"]
            if len(failed) == 3:
                assert all(c.error_code == "too_many_requests" and "session-1" in c.error for c in failed), failed
                session_run.stop()
        assert [c.status for c in session_run.columns.values()].count("cancelled") == 1

    run(main(), 20)


def _tiny_run(redis_server, keys, max_tokens: int, share_prompt: bool = False):
    from web.modes import Settings
    from web.session import Run, Service

    return Run(Service(redis_server.url, keys), Settings(prompt="Once upon a time", chat=False, max_tokens=max_tokens,
                                                         model="tiny"), share_prompt=share_prompt)


def test_the_runs_end_is_drawn_at_once_not_a_pace_later(redis_server, tiny_stack):
    """Frames wait out a budget (min_interval, or the last frame's size: Run.pace) before the next, but the run's
    end goes out when it happens: a pace of 30 s here would hold the last frame past the test's timeout."""
    session_run = _tiny_run(redis_server, tiny_stack[2], 8)

    async def main():
        frames = 0
        async for _ in session_run.updates(min_interval=0.01):
            frames += 1
            if any(c.first_token_at for c in session_run.columns.values()):
                session_run.pace = 30.0
        return frames

    assert run(main(), 20) >= 2
    assert [c.status for c in session_run.columns.values()] == ["done"] * 4, session_run.columns


def test_the_runs_first_token_is_drawn_at_once_not_a_pace_later(redis_server, tiny_llama_dir):
    """Before any frame has shown a token, the first one to arrive cuts the pause short (here a pace of 30 s): the
    replica starts only once the requests are queued, so their first token arrives during such a pause."""
    keys = _keys("first")
    engine, worker = _in_process_replica(redis_server, tiny_llama_dir, keys, "late")
    session_run = _tiny_run(redis_server, keys, 1500)  # runs on long after its first token
    started = []

    async def start_when_queued():
        while not all(c.entry_id for c in session_run.columns.values()):
            await asyncio.sleep(0.01)
        started.append(await asyncio.to_thread(worker.start))

    async def main():
        starter = asyncio.create_task(start_when_queued())
        async for _ in session_run.updates(min_interval=0.01):
            session_run.pace = 30.0
            firsts = [c.first_token_at for c in session_run.columns.values() if c.first_token_at]
            if firsts:
                session_run.stop()
                await starter
                return time.time() - min(firsts)

    try:
        gap = run(main(), 30)
        assert gap is not None, [(c.status, c.error) for c in session_run.columns.values()]
        assert gap < 1.0
    finally:
        if started:
            worker.stop()
        for rid in list(engine.requests):
            engine.abort(rid)


def test_the_pages_health_check_starts_loading_the_tokenizer_its_first_run_routes_with(redis_server, tiny_stack):
    """Loaded at the first Run instead, transformers' import held that run's first tokens up in the web process."""
    from web.session import Service

    _, _, keys = tiny_stack

    async def main():
        service = Service(redis_server.url, keys)
        ok, live = await service.health()
        assert ok and {info["model"] for info in live.values()} == {"tiny"}
        router = service.client().router
        loading = router._tokenizers.get("tiny")
        assert isinstance(loading, asyncio.Future), "the page's load started no tokenizer load"
        await asyncio.wait_for(loading, 60)
        assert router.tokenizer("tiny") is not None
        await service.client().close()

    run(main(), 90)
