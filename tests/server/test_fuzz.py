"""Fuzzing one real replica (subprocess, real Redis): hypothesis entries pushed into the stream, schemathesis on HTTP.

Each test prints how many cases it tried (`pytest -s` shows them; docs/security.md records a run).
"""
import json
import re
import uuid
from collections import Counter

import httpx
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from shared.client import EngineClient
from shared.keys import Keys
from shared.protocol import REQUEST_ID_PATTERN, DoneEvent, ErrorEvent, GenerationRequest, SamplingOptions, decode_event
from tests.helpers import GREEDY, run, wait_until
from tests.replicas import Replica

STREAM_EXAMPLES, HTTP_EXAMPLES = 120, 150
# no shrinking: each failing try costs a wait on the replica; the first failing case is reported as it is
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None,
                phases=[Phase.explicit, Phase.generate])
RID = "<request id>"  # replaced by a fresh id per example

leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)  # floats: NaN and inf too
huge = st.sampled_from([1 << 31, 1 << 63, 1 << 64, -(1 << 63) - 1, 10 ** 40, 1e308, -1e308, 5e-324])
weird = leaf | huge | st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                                max_size=3),
                                   max_leaves=8)
params = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 6), "min_tokens": st.integers(0, 6), "temperature": st.sampled_from([0, 0.5, 1.0]),
    "top_k": st.sampled_from([-1, 1, 5, (1 << 31) - 1]), "top_p": st.floats(0.05, 1), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(-(1 << 63), (1 << 63) - 1),
    "n": st.integers(1, 3), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=3), "ignore_eos": st.booleans(),
    "logprobs": st.none() | st.integers(0, 3),
    "mode": st.sampled_from([None, "greedy", "sample", "beam", "speculative"]), "beam_width": st.integers(1, 3),
    "length_penalty": st.floats(-10, 10), "early_stopping": st.sampled_from([True, False, "never"]),
    "num_speculative_tokens": st.integers(1, 4)})
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"]),
                                           "content": st.text(max_size=30)}), max_size=3)
TOP_FIELDS = [*GenerationRequest.model_fields, "surprise"]
PARAM_FIELDS = [*SamplingOptions.model_fields, "surprise"]


@st.composite
def bodies(draw) -> dict:
    """A valid-looking GenerationRequest, then 0-2 mutations: a field dropped, or set to anything at all."""
    prompt = st.text(max_size=40) | st.lists(st.integers(-3, 600), max_size=12)
    body = {"request_id": RID, **({"prompt": draw(prompt)} if draw(st.booleans()) else {"messages": draw(messages)}),
            "params": draw(params)}
    for _ in range(draw(st.integers(0, 2))):
        target = body if draw(st.booleans()) or not isinstance(body.get("params"), dict) else body["params"]
        key = draw(st.sampled_from(TOP_FIELDS if target is body else PARAM_FIELDS))
        if draw(st.booleans()):
            target.pop(key, None)
        else:
            target[key] = draw(weird)
    return body


value = st.text(max_size=20) | st.binary(max_size=20) | st.integers()
entries = st.one_of(
    st.tuples(st.just("body"), bodies()),
    st.tuples(st.just("raw data"), st.text(max_size=60) | st.binary(max_size=60)),  # not JSON, or not UTF-8
    st.tuples(st.just("raw fields"), st.dictionaries(st.sampled_from(["v", "id", "data"]) | st.text(max_size=4),
                                                     value, min_size=1, max_size=4)))


@pytest.fixture(scope="module")
def fuzz_replica(tiny_llama_dir, redis_server):
    keys = Keys(f"fuzz-{uuid.uuid4().hex[:8]}")
    replica = Replica(tiny_llama_dir, redis_server.url, keys, "fuzz", "--num-kv-blocks", "256",
                      "--max-num-seqs", "4", "--max-model-len", "128", "--default-max-tokens", "8",
                      "--claim-idle", "1.5", drain_timeout=2)
    try:
        yield replica.wait_ready(), keys
    finally:
        replica.kill()


def _fields(kind: str, payload) -> dict:
    rid = f"fz-{uuid.uuid4().hex}"
    if kind == "body":
        payload = dict(payload)
        if payload.get("request_id") == RID:
            payload["request_id"] = rid
        return {"v": "1", "id": rid, "data": json.dumps(payload)}  # json.dumps writes NaN / Infinity as such
    if kind == "raw data":
        return {"v": "1", "id": rid, "data": payload}
    return payload


def _answer_id(fields: dict, entry_id: str) -> str | None:
    """The request id the replica answers under, or None for an entry it must drop (no id or no data)."""
    raw = {(k.decode("utf-8", "replace") if isinstance(k, bytes) else k): v for k, v in fields.items()}
    if "id" not in raw or "data" not in raw:
        return None
    rid = raw["id"].decode("utf-8", "replace") if isinstance(raw["id"], bytes) else str(raw["id"])
    return rid if re.fullmatch(REQUEST_ID_PATTERN, rid) else f"invalid-{entry_id}"


def test_fuzzed_stream_entries_each_get_one_clear_answer_and_the_replica_survives(fuzz_replica, redis_server):
    replica, keys = fuzz_replica
    r = redis.Redis.from_url(redis_server.url)  # bytes: entries need not be UTF-8
    tried, answers = Counter(), Counter()

    @settings(FUZZ, max_examples=STREAM_EXAMPLES)
    @given(entry=entries)
    @example(entry=("body", {"request_id": RID, "prompt": "hello", "params": {"max_tokens": 2}}))
    @example(entry=("body", {"request_id": RID, "prompt": "hello", "params": {"temperature": float("nan")}}))
    def one(entry):
        fields = _fields(*entry)
        if (rid := _answer_id(fields, "")) and not rid.startswith("invalid-"):
            r.delete(keys.result(rid))  # a raw id may repeat across examples
        entry_id = r.xadd(keys.stream, fields).decode()
        tried[entry[0]] += 1
        rid = _answer_id(fields, entry_id)
        if rid is not None:
            result = wait_until(lambda: r.get(keys.result(rid)), 10, 0.01, f"an answer to {fields}")
            ev = decode_event(result)
            assert isinstance(ev, (DoneEvent, ErrorEvent)) and ev.request_id == rid
            assert not (isinstance(ev, ErrorEvent) and ev.code == "engine_error"), (fields, ev)  # input is refused
            answers[ev.type if isinstance(ev, DoneEvent) else ev.code] += 1
        else:
            answers["dropped"] += 1
        wait_until(lambda: not r.xrange(keys.stream, entry_id, entry_id), 10, 0.01, "the entry acknowledged")
        assert replica.proc.poll() is None, "the replica died"

    one()
    print(f"\nstream fuzzing: {sum(tried.values())} entries {dict(tried)} -> {dict(answers)}")
    assert sum(tried.values()) >= STREAM_EXAMPLES // 2 and answers["done"] > 0 and answers["invalid_request"] > 0
    assert r.xpending(keys.stream, keys.group)["pending"] == 0 and r.xlen(keys.stream) == 0

    async def good():
        c = EngineClient(redis_server.url, keys)
        done = await c.generate(GenerationRequest(prompt="still fine", params=SamplingOptions(
            max_tokens=3, **GREEDY)), timeout=20)
        await c.close()
        return done

    done = run(good())
    assert isinstance(done, DoneEvent) and len(done.outputs[0].token_ids) == 3
    r.close()


def test_schemathesis_on_the_openapi_schema_finds_no_5xx_and_the_replica_keeps_serving(fuzz_replica):
    replica, _ = fuzz_replica
    schema = schemathesis.openapi.from_url(f"{replica.url}/openapi.json", timeout=10)
    strategy = (schema.as_strategy(schemathesis.GenerationMode.POSITIVE)
                | schema.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    statuses = Counter()

    @settings(FUZZ, max_examples=HTTP_EXAMPLES)
    @given(case=strategy, served=st.booleans())
    def one(case, served):
        if served and isinstance(case.body, dict):  # else nearly every body names a model that is not served: 404
            case.body["model"] = "tiny"
        response = case.call(base_url=replica.url, timeout=30)
        statuses[f"{case.method} {case.path} {response.status_code}"] += 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])

    one()
    print(f"\nschemathesis: {sum(statuses.values())} cases -> {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= HTTP_EXAMPLES // 2
    assert replica.proc.poll() is None
    ok = httpx.post(f"{replica.url}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "still fine", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
