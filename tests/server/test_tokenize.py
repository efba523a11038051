"""vLLM's /tokenize and /detokenize on a replica's app and on an API front (the tokenizer the replicas publish to
Redis): the ids are those the engine runs, so `count` is what a request's usage reports."""
import pytest
from prometheus_client import CollectorRegistry

from .conftest import wait_until

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TEXT = "The capital of France is Paris."


@pytest.fixture(params=["api", "api_front"])
def http(request):
    """Each route on both kinds of app: a replica's, an API front's."""
    _, http = request.getfixturevalue(request.param)
    wait_until(lambda: http.get("/ready").status_code == 200, 30, what="ready")
    return http


def test_tokenize_gives_the_ids_the_engine_runs(http, engine):
    r = http.post("/tokenize", json={"model": "tiny", "prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = engine.tokenizer(TEXT).input_ids
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["token_strs"] == engine.tokenizer.convert_ids_to_tokens(want)
    assert body["max_model_len"] == engine.max_model_len
    done = http.post("/v1/completions", json={"model": "tiny", "prompt": TEXT, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == body["count"]
    no_special = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert no_special["tokens"] == engine.tokenizer(TEXT, add_special_tokens=False).input_ids
    assert no_special["token_strs"] is None


def test_tokenize_messages_counts_what_a_chat_request_reports(http, engine):
    body = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1}).json()
    assert body["count"] == chat["usage"]["prompt_tokens"] > 0
    text = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == engine.tokenizer(text).input_ids
    bare = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < body["count"]  # without the assistant's header


def test_detokenize_inverts_tokenize(http):
    ids = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    r = http.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": TEXT}, r.text


@pytest.mark.parametrize("path,body,status,mentions", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "exactly one of prompt and messages"),
    ("/tokenize", {}, 400, "exactly one"),
    ("/tokenize", {"prompt": "a", "tools": []}, 400, "tools need messages"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "'other' does not exist"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, 400, "below the tokenizer's vocabulary size"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "'other' does not exist"),
])
def test_bad_tokenizer_requests_are_clear_errors(http, path, body, status, mentions):
    r = http.post(path, json=body)
    assert r.status_code == status and mentions in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("front", [False, True])
def test_tokenize_is_a_503_until_the_model_can_be_served(redis_server, keys, front):
    from engine_service.server.api.app import create_app
    from engine_service.server.api.state import ServiceState
    from shared.client import EngineClient

    from .conftest import _serve

    state = ServiceState("unserved", EngineClient(redis_server.url, keys), CollectorRegistry(), front=front)
    for _, http in _serve(create_app(state), state):
        for path, body in [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})]:
            r = http.post(path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready", r.text
