"""The replica's HTTP API (real uvicorn, real worker and engine): health, metrics, OpenAI endpoints, bad input."""
import argparse
import json
import sys

import httpx
import pytest
import redis.utils
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine_service.engine.sampling_params import SamplingParams
from engine_service.server.engine_cmd import http_config
from shared.protocol import decode_event

from .conftest import wait_until

GREEDY = dict(temperature=0, ignore_eos=True)


def _sse(response) -> list:
    lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_the_api_runs_on_httptools_and_uvloop_and_reads_redis_with_hiredis():
    """What `engine` and `api` serve with (engine_cmd.http_config): the fast paths, not their pure-Python fallbacks
    (h11, asyncio's loop, redis-py's own parser), which cost the API ~30% more CPU per streamed token."""
    from fastapi import FastAPI

    config = http_config(FastAPI(), argparse.Namespace(host="127.0.0.1", port=0, log_level="warning"))
    config.load()
    assert config.http_protocol_class.__module__ == "uvicorn.protocols.http.httptools_impl"
    loop = config.get_loop_factory()()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()
    assert redis.utils.HIREDIS_AVAILABLE


def test_health_ready_and_models(api, engine):
    _, http = api
    assert http.get("/health").status_code == 200
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["model_loaded"] and ready.json()["redis"]
    (card,) = http.get("/v1/models").json()["data"]
    assert card["id"] == "tiny" and card["object"] == "model" and card["max_model_len"] == engine.max_model_len


def test_an_api_front_lists_the_model_once_a_replica_serves_it(api_front, engine):
    _, http = api_front
    wait_until(lambda: http.get("/ready").status_code == 200, 30, what="the worker's first heartbeat")
    (card,) = http.get("/v1/models").json()["data"]
    assert card["id"] == "tiny" and card["max_model_len"] == engine.max_model_len  # from the replica's heartbeat


@pytest.mark.parametrize("front,load_error,why", [
    (False, None, "the model is loading"), (False, "OSError: no such model", "the model failed to load: OSError"),
    (True, None, "no replica serves it yet")])
def test_models_answer_503_until_the_model_can_be_served(redis_server, keys, front, load_error, why):
    """A replica whose model still loads (or failed to), a front with no replica of its model: /v1/models is a 503
    with Retry-After, as /ready, so a client polling it before its first request does not wait out the load."""
    from engine_service.server.api.app import create_app
    from engine_service.server.api.state import ServiceState
    from shared.client import EngineClient

    from .conftest import _serve

    state = ServiceState("unserved", EngineClient(redis_server.url, keys), CollectorRegistry(), front=front,
                         load_error=load_error)
    for _, http in _serve(create_app(state), state):
        r = http.get("/v1/models")
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_ready" and why in error["message"], error
        assert http.get("/ready").status_code == 503 and http.get("/health").status_code == 200


def test_completion_equals_the_in_process_engine(api, reference_engine):
    _, http = api
    want = reference_engine.generate(["Hello world"], SamplingParams(max_tokens=10, logprobs=2, **GREEDY))[0]
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello world", "max_tokens": 10,
                                           "logprobs": 2, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == want.outputs[0].text and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 10 and body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 10
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])


def test_completion_n_seed_stop_and_extra_sampling_fields(api):
    _, http = api
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 8, "n": 2, "seed": 3, "temperature": 0.9,
            "top_k": 20, "min_p": 0.01, "ignore_eos": True}
    a, b = http.post("/v1/completions", json=body).json(), http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]  # seeded: reproducible
    full = http.post("/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 12, **GREEDY}).json()
    text = full["choices"][0]["text"]
    stopped = http.post("/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 12,
                                                 "stop": text[4:7], **GREEDY}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == text[:text.index(text[4:7])]


def test_chat_stream_matches_the_non_streamed_answer(api, reference_engine):
    _, http = api
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = reference_engine.chat(messages, SamplingParams(max_tokens=16, **GREEDY))[0].outputs[0].text
    body = {"model": "tiny", "messages": messages, "max_tokens": 16, **GREEDY}
    plain = http.post("/v1/chat/completions", json=body).json()
    assert plain["object"] == "chat.completion" and plain["choices"][0]["message"]["content"] == want
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_completion_stream(api, reference_engine):
    _, http = api
    want = reference_engine.generate(["Stream me"], SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0].text
    with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Stream me", "max_tokens": 20,
                                                      "stream": True, **GREEDY}) as r:
        chunks = _sse(r)
    assert len(chunks) > 2 and "".join(c["choices"][0]["text"] for c in chunks) == want


BAD = [
    (b'{"model": "tiny", "prompt": "x"', 400, "JSON"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "lots"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "mode": "telepathy"}, 400, "mode"),
    ({"model": "tiny", "prompt": "x", "mode": "greedy", "n": 2, "temperature": 0}, 400, "greedy"),
    ({"model": "tiny", "prompt": "word " * 3000, "max_tokens": 8}, 400, "context"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "tiny", "prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema"}}, 400, "json_schema"),
    ({"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "(["}}, 400, "structured_outputs"),
    ({"model": "tiny", "prompt": "x", "stop": ["a"] * 17}, 400, "stop"),  # the body allows it, the protocol does not
    ({"model": "tiny", "prompt": "x", "top_k": 1 << 63}, 400, "top_k"),  # would overflow the sampler's int64
    ({"model": "tiny", "prompt": "x", "mode": "beam", "temperature": 0, "length_penalty": 1e308}, 400, "length"),
    ({"model": "tiny", "prompt": "x", "seed": 1 << 64}, 400, "seed"),
    ({"model": "tiny", "prompt": [5, 1 << 70], "max_tokens": 2}, 400, "prompt"),  # was a 500 (the router's hash)
    ({"model": "tiny", "prompt": [5, -1], "max_tokens": 2}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"-1": 5}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [1 << 40]}, 400, "stop_token_ids"),
]


@pytest.mark.parametrize("body,status,mentions", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_clear_4xx_and_the_replica_keeps_serving(api, body, status, mentions):
    _, http = api
    if isinstance(body, bytes):
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert mentions in r.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "fine", "max_tokens": 3, **GREEDY})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_chat_with_bad_messages_is_rejected(api):
    _, http = api
    for messages in ([], [{"role": "wizard", "content": "x"}], [{"role": "user"}], "hi"):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
        assert r.status_code == 400, r.text


def test_a_full_queue_answers_429_with_retry_after(api):
    state, http = api
    state.client.max_queue = 0
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert int(r.headers["retry-after"]) >= 1


def test_beyond_the_inflight_bound_the_api_answers_429_with_retry_after(api):
    state, http = api
    state.max_inflight = 1
    body = {"model": "tiny", "prompt": "hold", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as held:
        lines = held.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        r = http.post("/v1/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests", r.text
        assert r.headers["retry-after"] == "1"
    # closing the stream ends that generation (the server notices the disconnect), which frees the slot
    wait_until(lambda: http.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200, 10, 0.2,
               "the slot freed")


def test_unknown_routes_and_methods_answer_openai_shaped_errors(api):
    _, http = api
    for r, status in ((http.get("/v1/nope"), 404), (http.get("/v1/completions"), 405)):
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["message"] and error["type"], error


def test_api_key_is_required_when_set(api):
    state, http = api
    state.api_key = "s3cret"
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    assert http.post("/v1/completions", json=body).status_code == 401
    assert http.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert http.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert http.get("/health").status_code == 200


def test_closing_the_stream_cancels_the_request(api, engine, sync_redis, keys):
    _, http = api
    idle_free = engine.block_manager.num_free_blocks
    with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Go on", "max_tokens": 1800,
                                                      "stream": True, **GREEDY}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
    rid = json.loads(first[6:])["id"]
    result = wait_until(lambda: sync_redis.get(keys.result(rid)), 10, what="cancelled result")
    done = decode_event(result)
    assert done.finish_reason == "cancelled" and len(done.outputs[0].token_ids) < 1800
    wait_until(lambda: engine.block_manager.num_free_blocks == idle_free and not engine.has_unfinished(), 5,
               what="blocks freed")


def test_metrics_expose_latencies_blocks_and_queue(api):
    _, http = api
    for _ in range(2):
        http.post("/v1/completions", json={"model": "tiny", "prompt": "abc abc", "max_tokens": 5, **GREEDY})
    wait_until(lambda: api[0].replica.state.stats.prefix_queries > 0, 3, what="stats refresh")
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("decodelab_time_to_first_token_seconds", "decodelab_time_per_output_token_seconds",
                 "decodelab_inter_token_latency_seconds", "decodelab_queue_time_seconds",
                 "decodelab_e2e_request_latency_seconds"):
        count = next(s.value for s in families[name].samples if s.name == f"{name}_count")
        assert count >= 2, name
    blocks = {s.labels["state"]: s.value for s in families["decodelab_kv_blocks"].samples}
    assert blocks["total"] == 512 and blocks["free"] + blocks["used"] <= 512
    assert 0 <= families["decodelab_prefix_cache_hit_rate"].samples[0].value <= 1
    for name in ("decodelab_preemptions", "decodelab_queue_length", "decodelab_num_running"):
        assert name in families, name


def test_beam_search_streams_its_final_beams(api):
    _, http = api
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 10, "mode": "beam", "beam_width": 3,
            "n": 2, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["choices"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = _sse(r)
    streamed = {}
    for c in chunks:
        choice = c["choices"][0]
        streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert [streamed[i] for i in (0, 1)] == [c["text"] for c in plain]
    assert plain[0]["text"] != plain[1]["text"]


def test_a_client_that_hangs_up_on_a_plain_request_cancels_it(api, engine, sync_redis, keys):
    _, http = api
    idle_free = engine.block_manager.num_free_blocks
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": "tiny", "prompt": "Hang up", "max_tokens": 1800, **GREEDY},
                  timeout=0.5)
    rid = wait_until(lambda: [k.split(":")[-1] for k in sync_redis.scan_iter(keys.result("cmpl-*"))], 10,
                     what="a result")[0]
    done = decode_event(sync_redis.get(keys.result(rid)))
    assert done.finish_reason == "cancelled" and len(done.outputs[0].token_ids) < 1800
    wait_until(lambda: engine.block_manager.num_free_blocks == idle_free and not engine.has_unfinished(), 5,
               what="blocks freed")
