"""What happens when things go wrong around a request: poison requests, dead consumers, a stopping replica,
a cancel that races the pickup, a failover of a sampled stream."""
import asyncio
import signal
import time

import httpx

from shared.client import EngineClient, TextAccumulator
from shared.protocol import DoneEvent, ErrorEvent, GenerationRequest, SamplingOptions, TokenEvent, decode_request
from tests.helpers import GREEDY, run, wait_until
from tests.replicas import Replica
from web.columns import Column


async def _finish(client: EngineClient, request: GenerationRequest, timeout: float = 60):
    sub = await client.submit(request)
    return [ev async for ev in client.stream(sub, timeout)]


def _events(redis_server, keys, request: GenerationRequest) -> list:
    """Every event of `request`, submitted by a fresh client."""
    async def go():
        client = EngineClient(redis_server.url, keys)
        try:
            return await _finish(client, request)
        finally:
            await client.close()

    return run(go())


def test_a_request_that_took_down_every_replica_goes_to_the_dead_letter_stream(worker, redis_server, keys,
                                                                              sync_redis):
    max_attempts = worker.state.cfg.max_attempts
    request = GenerationRequest(prompt="poison", params=SamplingOptions(max_tokens=4, **GREEDY))
    # the attempt counter as max_attempts earlier pickups left it (each of those replicas died mid-run)
    sync_redis.set(keys.attempt(request.request_id), max_attempts)
    events = _events(redis_server, keys, request)
    assert isinstance(events[-1], ErrorEvent) and events[-1].code == "too_many_attempts", events[-1]
    assert keys.dead_letter in events[-1].message
    dead = sync_redis.xrange(keys.dead_letter)
    assert len(dead) == 1 and dead[0][1]["id"] == request.request_id
    assert int(dead[0][1]["attempts"]) == max_attempts + 1
    assert decode_request(dead[0][1]["data"]).prompt == "poison"  # kept whole for a person to read
    assert sync_redis.xlen(keys.stream) == 0  # acknowledged and deleted: nobody runs it again


def test_consumers_of_replicas_that_are_gone_are_removed_from_the_group(make_worker, redis_server, keys,
                                                                         sync_redis):
    sync_redis.xgroup_create(keys.stream, keys.group, id="0", mkstream=True)
    sync_redis.xreadgroup(keys.group, "ghost", {keys.stream: ">"}, count=1)  # a consumer that then went away
    make_worker(consumer_gc_idle_s=0.3)

    def consumers() -> set[str]:
        return {c["name"] for c in sync_redis.xinfo_consumers(keys.stream, keys.group)}

    wait_until(lambda: "ghost" not in consumers(), 10, 0.1, "the ghost consumer removed")
    sync_redis.xreadgroup(keys.group, "alive", {keys.stream: ">"}, count=1)
    sync_redis.set(keys.replica("alive"), "{}", px=60_000)  # it heart-beats: it stays, however idle
    time.sleep(1.0)
    assert "alive" in consumers()


def test_a_cancel_that_arrives_between_pickup_and_registration_is_not_lost(worker, redis_server, keys):
    """The cancel is published right after the replica read the request's cancel mark: it must still land."""
    state = worker.state
    request = GenerationRequest(prompt="race", params=SamplingOptions(max_tokens=200, **GREEDY))
    pipeline = state.redis.pipeline

    def racing_pipeline(*args, **kwargs):
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        def execute_then_cancel(*a, **kw):
            reads_the_mark = any(cmd[0][:2] == ("EXISTS", keys.cancelled(request.request_id))
                                 for cmd in pipe.command_stack)
            result = execute(*a, **kw)
            if reads_the_mark:
                state.redis.set(keys.cancelled(request.request_id), "1", ex=60)
                state.redis.publish(keys.cancel_channel, request.request_id)
                time.sleep(0.3)  # the control thread hears the cancel before the job would be registered
            return result

        pipe.execute = execute_then_cancel
        return pipe

    state.redis.pipeline = racing_pipeline
    try:
        events = _events(redis_server, keys, request)
    finally:
        state.redis.pipeline = pipeline
    assert isinstance(events[-1], DoneEvent) and events[-1].finish_reason == "cancelled", events[-1]


def test_a_stopping_replica_hands_back_what_it_could_not_finish(make_worker, redis_server, keys, sync_redis,
                                                                  reference_engine):
    from engine_service.engine.sampling_params import SamplingParams

    first = make_worker(claim_idle_s=30.0)
    request = GenerationRequest(prompt="handed back", params=SamplingOptions(max_tokens=300, **GREEDY))
    expected = reference_engine.generate(["handed back"], SamplingParams(max_tokens=300, **GREEDY))[0]

    async def go():
        client = EngineClient(redis_server.url, keys)
        try:
            sub = await client.submit(request)
            events = []
            async for ev in client.stream(sub, 120):
                events.append(ev)
                if isinstance(ev, TokenEvent) and len(events) == 3:
                    handed = await asyncio.to_thread(first.hand_back)
                    assert handed == 1
                    pending = sync_redis.xpending_range(sub.stream, keys.group, "-", "+", 10)
                    assert pending[0]["time_since_delivered"] > 30_000  # claimable by any replica at once
                    assert not first.state.jobs and not first.engine.has_unfinished()
                    await asyncio.to_thread(first.stop)  # (the fixtures' replicas share one engine)
                    make_worker(claim_idle_s=30.0)  # the next replica takes it on its first pass
            return events, sub
        finally:
            await client.close()

    events, sub = run(go(), timeout=120)
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.attempt == 2 and sub.restarts == 1
    assert done.outputs[0].token_ids == expected.outputs[0].token_ids


def test_sigterm_stops_intake_at_once_while_open_streams_drain(tiny_llama_dir, redis_server, keys, sync_redis):
    replica = Replica(tiny_llama_dir, redis_server.url, keys, "stopping", drain_timeout=30.0).wait_ready()
    try:
        with httpx.Client(base_url=replica.url, timeout=60) as http:
            body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "stream": True, **GREEDY}
            with http.stream("POST", "/v1/completions", json=body) as held:
                lines = held.iter_lines()  # kept: the stream stays open while we do not read it
                next(line for line in lines if line.startswith("data: "))
                replica.proc.send_signal(signal.SIGTERM)
                time.sleep(1.0)  # the open stream keeps the process alive and draining
                assert replica.proc.poll() is None
                late = GenerationRequest(prompt="late", params=SamplingOptions(max_tokens=2, **GREEDY))

                async def submit() -> tuple[str, str]:
                    client = EngineClient(redis_server.url, keys)
                    try:
                        sub = await client.submit(late)
                        await sub.close()
                        return sub.entry_id, sub.stream
                    finally:
                        await client.close()

                entry, stream = run(submit())
                assert stream == keys.stream  # the replica said at the signal that it takes no more: not routed to it
                time.sleep(1.5)
                # still in the stream, delivered to nobody, no result: the stopping replica did not take it
                assert sync_redis.xrange(stream, entry, entry), "the stopping replica ran new work"
                delivered = {p["message_id"] for p in sync_redis.xpending_range(stream, keys.group, "-", "+", 10)}
                assert entry not in delivered and not sync_redis.exists(keys.result(late.request_id))
    finally:
        replica.kill()


def test_a_failover_that_changes_the_text_is_reported_never_mixed():
    acc = TextAccumulator()

    def token(attempt: int, text: str, seq: int) -> TokenEvent:
        return TokenEvent(request_id="r", seq=seq, attempt=attempt, index=0, text_delta=text, token_ids=[1])

    assert acc.feed(token(1, "The sky", 0)) == "The sky"
    assert acc.feed(token(2, "The", 0)) == "" and not acc.diverged  # the re-run catches up
    assert acc.feed(token(2, " sky is", 1)) == " is" and not acc.diverged  # and continues
    assert acc.feed(token(3, "A cloud", 0)) == "" and acc.diverged  # a different re-run: the caller ends with an error


def test_a_failover_that_ends_shorter_than_what_was_streamed_is_reported():
    acc = TextAccumulator()
    acc.feed(TokenEvent(request_id="r", seq=0, attempt=1, index=0, text_delta="Hello there", token_ids=[1]))
    assert acc.final(0, "Hello") == "" and acc.diverged


def test_sampled_requests_get_a_seed_at_submit_so_a_rerun_continues_the_same_text(redis_server, keys, sync_redis):
    async def go():
        client = EngineClient(redis_server.url, keys)
        try:
            subs = [await client.submit(GenerationRequest(prompt="x", params=SamplingOptions(temperature=0.8))),
                    await client.submit(GenerationRequest(prompt="x", params=SamplingOptions(temperature=0.8,
                                                                                             seed=7))),
                    await client.submit(GenerationRequest(prompt="x", params=SamplingOptions(**GREEDY)))]
            for sub in subs:
                await sub.close()
            return subs
        finally:
            await client.close()

    run(go())
    stored = [decode_request(fields["data"]).params.seed for _, fields in sync_redis.xrange(keys.stream)]
    assert stored[0] is not None and stored[1] == 7 and stored[2] is None


def test_the_playground_column_shows_a_rerun_from_its_start():
    col = Column("sample")
    col.feed(TokenEvent(request_id="r", seq=0, attempt=1, index=0, text_delta="old run", token_ids=[1]))
    col.feed(TokenEvent(request_id="r", seq=0, attempt=2, index=0, text_delta="new", token_ids=[2]))
    assert col.outputs[0].text == "new" and col.outputs[0].token_ids == [2] and col.restarts == 1
