"""Service limits (shared/limits.py) against a real Redis and a real replica: prompt size, n, beam width, per client."""
import pytest
import redis.asyncio as aioredis

from shared.client import ClientBusy, EngineClient
from shared.limits import Limits
from shared.protocol import ChatMessage, DoneEvent, ErrorEvent, GenerationRequest, SamplingOptions, TokenEvent
from tests.helpers import GREEDY, run, wait_until

TEXTS = ["the " * 25, "x" * 100, "\U0001F600" * 25, "".join(chr(33 + i % 90) for i in range(100))]  # 100 bytes each


def _fewest_and_most_tokens(tokenizer) -> tuple[str, int, str]:
    """Two 100-byte prompts with different token counts: (fewest, its count, most)."""
    counts = sorted((len(tokenizer(t).input_ids), t) for t in TEXTS)
    assert counts[0][0] < counts[-1][0] and all(len(t.encode()) == 100 for t in TEXTS)
    return counts[0][1], counts[0][0], counts[-1][1]


def _client(redis_server, keys, **kw) -> EngineClient:
    return EngineClient(aioredis.Redis.from_url(redis_server.url, decode_responses=True), keys, **kw)


def test_limits_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("DECODELAB_MAX_PROMPT_BYTES", "1000")
    monkeypatch.setenv("DECODELAB_MAX_PER_CLIENT", "0")
    assert Limits.from_env() == Limits(max_prompt_bytes=1000, max_per_client=0)


def test_requests_over_a_limit_get_limit_exceeded_and_requests_at_it_run(make_worker, engine, redis_server, keys):
    few, max_tokens, many = _fewest_and_most_tokens(engine.tokenizer)
    make_worker(limits=Limits(max_request_bytes=4000, max_prompt_bytes=100, max_prompt_tokens=max_tokens, max_n=2,
                              max_beam_width=2))
    over = {
        "prompt bytes": GenerationRequest(prompt=few + "x"),
        "chat bytes": GenerationRequest(messages=[ChatMessage(role="user", content="y" * 60)] * 2),
        "token ids": GenerationRequest(prompt=list(range(max_tokens + 1))),
        "text tokens": GenerationRequest(prompt=many),
        "n": GenerationRequest(prompt="x", params=SamplingOptions(n=3, seed=1)),
        "beam width": GenerationRequest(prompt="x", params=SamplingOptions(mode="beam", beam_width=3, temperature=0)),
        "request bytes": GenerationRequest(messages=[ChatMessage(role="user", content="")] * 200),
    }
    at = [GenerationRequest(prompt=few, params=SamplingOptions(max_tokens=2, **GREEDY)),
          GenerationRequest(prompt=list(range(1, max_tokens + 1)), params=SamplingOptions(max_tokens=2, **GREEDY)),
          GenerationRequest(prompt="x", params=SamplingOptions(n=2, seed=1, max_tokens=2)),
          GenerationRequest(prompt="x", params=SamplingOptions(mode="beam", beam_width=2, temperature=0, max_tokens=2))]

    async def main():
        c = _client(redis_server, keys)
        refused = {name: await c.generate(req, timeout=20) for name, req in over.items()}
        ran = [await c.generate(req, timeout=20) for req in at]
        await c.close()
        return refused, ran

    refused, ran = run(main())
    for name, ev in refused.items():
        assert isinstance(ev, ErrorEvent) and ev.code == "limit_exceeded", (name, ev)
        assert "this service's limit" in ev.message and "DECODELAB_MAX_" in ev.message, ev.message
    assert "101 bytes" in refused["prompt bytes"].message and "120 bytes" in refused["chat bytes"].message
    assert f"{max_tokens + 1} tokens" in refused["token ids"].message
    assert "MAX_PROMPT_TOKENS" in refused["text tokens"].message
    assert refused["n"].message.startswith("n: 3") and refused["beam width"].message.startswith("beam_width: 3")
    assert "REQUEST_BYTES" in refused["request bytes"].message
    assert all(isinstance(ev, DoneEvent) for ev in ran), ran


async def _hold(c: EngineClient, client_id: str):
    """Submit a long request for this client and wait until it is generating."""
    sub = await c.submit(GenerationRequest(prompt="hold", client_id=client_id,
                                           params=SamplingOptions(max_tokens=1500, **GREEDY)))
    events = c.stream(sub, 30)
    assert isinstance(await anext(events), TokenEvent)
    return sub, events


def test_a_client_over_its_concurrency_limit_is_refused_until_one_of_its_requests_ends(worker, redis_server, keys,
                                                                                        sync_redis):
    async def main():
        c = _client(redis_server, keys, max_per_client=2)
        held = [await _hold(c, "alice") for _ in range(2)]
        with pytest.raises(ClientBusy) as busy:
            await c.submit(GenerationRequest(prompt="third", client_id="alice"))
        bob = await c.generate(GenerationRequest(prompt="other client", client_id="bob",
                                                 params=SamplingOptions(max_tokens=2, **GREEDY)), timeout=20)
        await c.cancel(held[0][0].request_id)
        first_end = [ev async for ev in held[0][1]][-1]
        again = await c.generate(GenerationRequest(prompt="now fits", client_id="alice",
                                                   params=SamplingOptions(max_tokens=2, **GREEDY)), timeout=20)
        await c.cancel(held[1][0].request_id)
        [ev async for ev in held[1][1]]
        await c.close()
        return busy.value, bob, first_end, again

    busy, bob, first_end, again = run(main())
    assert busy.code == "too_many_requests" and "'alice' has 2 queued or running (limit 2)" in str(busy)
    assert isinstance(bob, DoneEvent)
    assert isinstance(first_end, DoneEvent) and first_end.finish_reason == "cancelled"
    assert isinstance(again, DoneEvent)
    wait_until(lambda: sync_redis.zcard(keys.client("alice")) == 0, 5, what="alice's slots freed by the finishes")


def test_openai_endpoints_answer_400_over_a_limit_and_429_over_the_client_limit(api, engine):
    state, http = api
    few, max_tokens, many = _fewest_and_most_tokens(engine.tokenizer)
    state.limits = Limits(max_request_bytes=2000, max_prompt_bytes=100, max_n=2)
    state.replica.state.cfg.limits = Limits(max_prompt_tokens=max_tokens)  # text prompts are counted by the replica
    body = {"model": "tiny", "max_tokens": 2, **GREEDY}
    for extra, mentions, status in (({"prompt": "x" * 101}, "101 bytes", 400),
                                    ({"prompt": "x", "n": 3, "temperature": 1}, "n: 3", 400),
                                    ({"prompt": "x", "stop": ["s" * 150] * 16}, "bytes of JSON", 413),  # HTTP body
                                    ({"prompt": many}, "tokens", 400)):
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == "limit_exceeded" and mentions in r.json()["error"]["message"]
    state.client.max_per_client = 1
    with http.stream("POST", "/v1/completions", json={**body, "prompt": "hold", "max_tokens": 1500,
                                                      "stream": True}) as held:
        lines = held.iter_lines()  # kept: a dropped iterator may close the stream, freeing the slot early
        next(line for line in lines if line.startswith("data: "))
        r = http.post("/v1/completions", json={**body, "prompt": "x"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests", r.text
        assert r.headers["retry-after"] == "1"

    def admitted():  # closing the stream cancelled the held request, whose finish frees the client's slot
        r = http.post("/v1/completions", json={**body, "prompt": "x"})
        assert r.status_code in (200, 429), r.text
        return r if r.status_code == 200 else None

    assert wait_until(admitted, 10, 0.1, "the client's slot freed").json()["usage"]["completion_tokens"] == 2


def test_an_oversized_body_is_refused_before_it_is_read_declared_or_chunked(api):
    state, http = api
    state.limits = Limits(max_request_bytes=2000)
    declared = http.post("/v1/completions", content=b"{" + b" " * 5000 + b"}",
                         headers={"content-type": "application/json"})

    def chunked():  # no Content-Length: counted as it arrives, refused once past the limit
        for i in range(200):
            yield b'{"prompt": "' if i == 0 else b"x" * 100
    streamed = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "limit_exceeded" and "bytes of JSON" in r.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **GREEDY})
    assert ok.status_code == 200, ok.text  # the next request is served
