"""One in-process replica (real engine on a tiny model, real Redis): streaming, batching, cancel, bad input."""
import asyncio
import json
import time

import redis.asyncio as aioredis

from engine_service.engine.sampling_params import SamplingParams
from shared.client import EngineClient, TextAccumulator
from shared.protocol import (
    PROTOCOL_VERSION,
    ChatMessage,
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    SamplingOptions,
    TokenEvent,
    decode_event,
)

from .conftest import run, wait_until

GREEDY = dict(temperature=0, ignore_eos=True)


def _client(redis_server, keys, **kw) -> EngineClient:
    return EngineClient(aioredis.Redis.from_url(redis_server.url, decode_responses=True), keys, **kw)


def _expected(reference_engine, prompt, **params) -> str:
    return reference_engine.generate([prompt], SamplingParams(**params))[0].outputs[0].text


async def _collect(client: EngineClient, request: GenerationRequest, timeout: float = 30):
    sub = await client.submit(request)
    events = [ev async for ev in client.stream(sub, timeout)]
    return sub, events


def test_greedy_result_through_redis_equals_the_in_process_engine(worker, redis_server, keys, reference_engine):
    prompt = "The capital of France is"
    want = _expected(reference_engine, prompt, max_tokens=24, **GREEDY)

    async def main():
        c = _client(redis_server, keys)
        request = GenerationRequest(prompt=prompt, params=SamplingOptions(max_tokens=24, **GREEDY))
        sub, events = await _collect(c, request)
        await c.close()
        return sub, events

    sub, events = run(main())
    tokens, done = events[:-1], events[-1]
    assert isinstance(done, DoneEvent) and done.text == want and done.finish_reason == "length"
    assert [e.seq for e in tokens] == list(range(len(tokens))) and done.seq == len(tokens)
    assert "".join(e.text_delta for e in tokens) == want
    assert sum(len(e.token_ids) for e in tokens) == 24 == done.metrics.completion_tokens
    assert done.metrics.replica == worker.state.cfg.name and done.metrics.ttft_s > 0 and sub.gaps == 0


def test_concurrent_clients_batch_together_with_separate_streams(worker, redis_server, keys, reference_engine):
    prompts = [f"Request number {i} says" for i in range(8)]
    want = [o.outputs[0].text for o in reference_engine.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))]

    async def main():
        c = _client(redis_server, keys)
        results = await asyncio.gather(*(_collect(c, GenerationRequest(
            prompt=p, params=SamplingOptions(max_tokens=40, **GREEDY))) for p in prompts))
        await c.close()
        return results

    results = run(main())
    for (sub, events), expected in zip(results, want):
        assert all(e.request_id == sub.request_id for e in events)
        assert "".join(e.text_delta for e in events if isinstance(e, TokenEvent)) == expected
        assert events[-1].text == expected
    assert worker.state.max_batch > 1


def test_chat_messages_stop_strings_n_and_logprobs(worker, redis_server, keys, reference_engine):
    messages = [ChatMessage(role="user", content="Hello there")]
    prompt = reference_engine.apply_chat_template([m.model_dump() for m in messages])
    want = _expected(reference_engine, prompt, max_tokens=12, **GREEDY)

    async def main():
        c = _client(redis_server, keys)
        chat = await c.generate(GenerationRequest(messages=messages, params=SamplingOptions(max_tokens=12, **GREEDY)))
        many = await c.generate(GenerationRequest(prompt="Once upon", params=SamplingOptions(
            n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=2, ignore_eos=True)))
        stop_at = want[3:6]
        stopped = await c.generate(GenerationRequest(messages=messages, params=SamplingOptions(
            max_tokens=12, stop=[stop_at], **GREEDY)))
        await c.close()
        return chat, many, stopped, stop_at

    chat, many, stopped, stop_at = run(main())
    assert chat.text == want
    assert [o.index for o in many.outputs] == [0, 1, 2]
    for o in many.outputs:
        assert len(o.token_ids) == 8 and len(o.logprobs) == 8
        assert all(lp.token_id == t and 1 <= len(lp.top) <= 3 for lp, t in zip(o.logprobs, o.token_ids))
    assert stopped.finish_reason == "stop" and stopped.text == want[:want.index(stop_at)]


def test_cancel_mid_stream_frees_the_blocks(worker, engine, redis_server, keys):
    idle_free = engine.block_manager.num_free_blocks

    async def main():
        c = _client(redis_server, keys)
        sub = await c.submit(GenerationRequest(prompt="Tell me a long story", params=SamplingOptions(
            max_tokens=1500, **GREEDY)))
        n_tokens = 0
        async for ev in c.stream(sub, 30):
            if isinstance(ev, TokenEvent):
                n_tokens += 1
                if n_tokens == 5:
                    assert engine.block_manager.num_free_blocks < idle_free
                    await c.cancel(sub.request_id)
            else:
                free_at_done = engine.block_manager.num_free_blocks
                await c.close()
                return ev, n_tokens, free_at_done

    done, n_tokens, free_at_done = run(main())
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
    assert 5 <= n_tokens < 200 and len(done.outputs[0].token_ids) >= 5
    assert free_at_done == idle_free  # freed before the cancelled result was published
    assert not engine.has_unfinished()


def test_a_request_cancelled_while_queued_never_runs(make_worker, redis_server, keys):
    async def main():
        c = _client(redis_server, keys)
        sub = await c.submit(GenerationRequest(prompt="x", params=SamplingOptions(max_tokens=5, **GREEDY)))
        await c.cancel(sub.request_id)
        make_worker()  # the replica starts only now
        events = [ev async for ev in c.stream(sub, 20)]
        await c.close()
        return events

    events = run(main())
    assert len(events) == 1 and events[0].finish_reason == "cancelled" and events[0].outputs[0].token_ids == []


def test_deadlines_drop_requests_with_an_error_event(worker, redis_server, keys):
    async def main():
        c = _client(redis_server, keys)
        late = await c.generate(GenerationRequest(prompt="x", deadline=time.time() - 1))
        during = await c.generate(GenerationRequest(prompt="x", deadline=time.time() + 0.3, params=SamplingOptions(
            max_tokens=1900, **GREEDY)))
        await c.close()
        return late, during

    late, during = run(main())
    assert isinstance(late, ErrorEvent) and late.code == "deadline_exceeded" and "queued" in late.message
    assert isinstance(during, ErrorEvent) and during.code == "deadline_exceeded" and "during" in during.message


BAD_ENTRIES = {
    "not-json": "{oops",
    "wrong-types": '{"request_id": "%s", "prompt": "x", "params": {"max_tokens": "many"}}',
    "unknown-mode": '{"request_id": "%s", "prompt": "x", "params": {"mode": "telepathy"}}',
    "nan-temperature": '{"request_id": "%s", "prompt": "x", "params": {"temperature": NaN}}',
    "missing-prompt": '{"request_id": "%s"}',
    "oversized-prompt": '{"request_id": "%s", "prompt": "%s", "params": {"max_tokens": 8}}',
    "engine-rules": '{"request_id": "%s", "prompt": "x", "params": {"mode": "greedy", "n": 2}}',
    "other-model": '{"request_id": "%s", "prompt": "x", "model": "gpt-9"}',
}


def test_bad_stream_entries_get_error_events_and_the_replica_keeps_serving(worker, redis_server, keys, sync_redis):
    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        ps = r.pubsub()
        rids = [f"bad-{name}" for name in BAD_ENTRIES] + ["bad-version"]
        await ps.subscribe(*(keys.events(rid) for rid in rids))
        for (name, data), rid in zip(BAD_ENTRIES.items(), rids):
            data = data % ((rid, "word " * 3000) if name == "oversized-prompt" else (rid,)) if "%s" in data else data
            await r.xadd(keys.stream, {"v": PROTOCOL_VERSION, "id": rid, "data": data})
        await r.xadd(keys.stream, {"v": 99, "id": "bad-version", "data": "{}"})
        await r.xadd(keys.stream, {"garbage": "no id at all"})
        errors = {}
        end = time.monotonic() + 20
        while len(errors) < len(rids) and time.monotonic() < end:
            msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if msg:
                ev = decode_event(msg["data"])
                errors[ev.request_id] = ev
        await ps.aclose()
        c = EngineClient(r, keys)
        ok = await c.generate(GenerationRequest(prompt="still there?", params=SamplingOptions(max_tokens=4, **GREEDY)))
        await c.close()
        return rids, errors, ok

    rids, errors, ok = run(main())
    assert set(errors) == set(rids)
    assert all(isinstance(e, ErrorEvent) for e in errors.values())
    assert errors["bad-version"].code == "unsupported_version"
    assert {e.code for rid, e in errors.items() if rid != "bad-version"} == {"invalid_request"}
    assert "mode" in errors["bad-unknown-mode"].message and "temperature" in errors["bad-nan-temperature"].message
    assert "context" in errors["bad-oversized-prompt"].message and "gpt-9" in errors["bad-other-model"].message
    for rid in rids:  # each error is also the request's result
        assert decode_event(sync_redis.get(keys.result(rid))) == errors[rid]
    assert isinstance(ok, DoneEvent) and len(ok.outputs[0].token_ids) == 4
    wait_until(lambda: sync_redis.xlen(keys.stream) == 0, 5, what="every entry acknowledged and deleted")


def test_a_late_subscriber_recovers_the_whole_result(worker, redis_server, keys):
    async def main():
        c = _client(redis_server, keys, recover_after=0.2)
        first = await c.generate(GenerationRequest(prompt="abc", params=SamplingOptions(max_tokens=6, **GREEDY)))
        again = await c.result(first.request_id)
        await c.close()
        return first, again

    first, again = run(main())
    assert again == first


def test_text_accumulator_delivers_append_only_text():
    acc = TextAccumulator()
    parts = [acc.feed(TokenEvent(request_id="r", seq=i, text_delta=t, token_ids=[i])) for i, t in enumerate("abc")]
    parts.append(acc.feed(TokenEvent(request_id="r", seq=0, attempt=2, text_delta="abcd", token_ids=[1])))
    parts.append(acc.feed(TokenEvent(request_id="r", seq=1, attempt=2, text_delta="xyz", token_ids=[1], reset=True)))
    parts.append(acc.final(0, "abcdef"))
    assert "".join(parts) == "abcdef"


def test_entries_left_by_a_dead_consumer_are_claimed_and_run(make_worker, redis_server, keys, sync_redis):
    async def main():
        c = _client(redis_server, keys)
        sub = await c.submit(GenerationRequest(prompt="orphan", params=SamplingOptions(max_tokens=5, **GREEDY)))
        gone = await c.submit(GenerationRequest(prompt="deleted", params=SamplingOptions(max_tokens=5, **GREEDY)))
        await gone.close()
        sync_redis.xreadgroup(keys.group, "ghost", {keys.stream: ">"}, count=10)  # a consumer that then died
        sync_redis.xdel(keys.stream, gone.entry_id)  # and an entry removed behind the group's back
        make_worker(claim_idle_s=0.5)
        events = [ev async for ev in c.stream(sub, 20)]
        later = await c.generate(GenerationRequest(prompt="next", params=SamplingOptions(max_tokens=3, **GREEDY)),
                                 timeout=10)
        await c.close()
        return events, later

    events, later = run(main())
    assert isinstance(events[-1], DoneEvent) and len(events[-1].outputs[0].token_ids) == 5
    assert isinstance(later, DoneEvent)  # and the replica still serves
    wait_until(lambda: sync_redis.xpending(keys.stream, keys.group)["pending"] == 0, 5, what="pending list empty")


def test_beam_and_speculative_modes_through_redis(worker, redis_server, keys, reference_engine):
    prompt = "The quick brown fox"
    beam = dict(mode="beam", beam_width=3, n=2, temperature=0, max_tokens=10, ignore_eos=True)
    spec = dict(mode="speculative", proposer="ngram", num_speculative_tokens=3, temperature=0, max_tokens=24,
                ignore_eos=True)
    want_beam = [o.text for o in reference_engine.generate([prompt], SamplingParams(**beam))[0].outputs]
    want_greedy = _expected(reference_engine, prompt, max_tokens=24, **GREEDY)

    async def main():
        c = _client(redis_server, keys)
        results = [await _collect(c, GenerationRequest(prompt=prompt, params=SamplingOptions(**p)))
                   for p in (beam, spec)]
        await c.close()
        return results

    (_, beam_events), (_, spec_events) = run(main())
    done = beam_events[-1]
    assert isinstance(done, DoneEvent) and [o.text for o in done.outputs] == want_beam
    assert all(o.score is not None for o in done.outputs)
    shown: dict[int, str] = {}  # beams are rewritten as they overtake each other: `reset` events say so
    for e in beam_events[:-1]:
        shown[e.index] = e.text_delta if e.reset else shown.get(e.index, "") + e.text_delta
    assert any(e.reset for e in beam_events[:-1]) and [shown[i] for i in sorted(shown)] == want_beam
    done = spec_events[-1]
    assert isinstance(done, DoneEvent) and done.text == want_greedy  # speculative greedy == plain greedy
    marks = [m for e in spec_events[:-1] for m in e.spec]
    assert len(marks) == 24 and set(marks) <= {"accepted", "resampled", "bonus", "target"}
    assert done.metrics.spec is not None


def test_a_started_replica_has_already_said_it_accepts_work(make_worker, keys, sync_redis):
    """Routers route only to replicas whose heartbeat says `accepting`: the first one is written before start()
    returns, so /ready (which waits for start) never precedes it."""
    w = make_worker(claim_idle_s=40.0)  # beats every second: the periodic one cannot have come first by chance
    beat = sync_redis.get(keys.replica(w.state.cfg.name))
    assert beat is not None and json.loads(beat)["accepting"] is True
    assert sync_redis.zscore(keys.live, w.state.cfg.name) is not None
