"""`decodelab engine` as a real process: the SIGTERM drain, the API key (flag and environment), a request bigger
than the KV pool refused over HTTP."""
import asyncio
import signal

import httpx
import pytest
import redis.asyncio as aioredis

from shared import monitor
from shared.client import EngineClient
from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions, TokenEvent
from tests.helpers import GREEDY, run, wait_until

KEY = "s3cret-key"
BODY = {"model": "tiny", "prompt": "Readability counts.", "max_tokens": 3, **GREEDY}


def refuses_connections(replica) -> bool:
    """No answer over HTTP any more: the connection refused, or, in the moment the server closes its socket, taken
    and closed without a response (uvicorn's shutdown; a probe that raised on that failed this test on a slow box)."""
    try:
        httpx.get(f"{replica.url}/health", timeout=0.5)
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True
    return False


def test_sigterm_finishes_the_running_request_takes_no_new_one_and_exits_0(spawn_replica, redis_server, keys):
    replica = spawn_replica("draining", drain_timeout=60).wait_ready()

    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        client = EngineClient(r, keys)
        running = await client.submit(GenerationRequest(prompt="Drain me", params=SamplingOptions(
            max_tokens=1000, **GREEDY)))
        events = client.stream(running, 60)
        assert isinstance(await anext(events), TokenEvent)  # generating when the signal comes
        replica.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(wait_until, lambda: refuses_connections(replica), 10, 0.02, "the HTTP server closed")
        await asyncio.sleep(0.5)  # the drain has begun; past the intake's last blocking read (100 ms)
        late = await client.submit(GenerationRequest(prompt="Too late", params=SamplingOptions(
            max_tokens=3, **GREEDY)))
        rest = [ev async for ev in events]
        code = await asyncio.to_thread(replica.proc.wait, 30)
        position = await monitor.queue_position(r, keys, late.entry_id, late.stream)
        owner = await r.get(keys.owner(late.request_id))
        await late.close()
        await client.close()
        return rest[-1], code, position, owner

    done, code, position, owner = run(main(), 90)
    assert isinstance(done, DoneEvent) and done.finish_reason == "length", done
    assert len(done.outputs[0].token_ids) == 1000  # ran to the end, not cut off by the shutdown
    assert code == 0
    assert (position, owner) == (1, None)  # still first in the queue for another replica


@pytest.fixture(scope="module")
def keyed_replica(tiny_llama_dir, redis_server):
    """A replica started with --api-key and a KV pool of 8 blocks of 16 (128 tokens)."""
    from shared.keys import Keys
    from tests.replicas import Replica

    replica = Replica(tiny_llama_dir, redis_server.url, Keys("test-keyed"), "keyed", "--api-key", KEY,
                      "--num-kv-blocks", "8", "--block-size", "16")
    yield replica.wait_ready()
    replica.stop()


def assert_key_required(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/v1/completions", json=BODY).status_code == 401
        wrong = http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer not-it"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        ok = http.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 3


def test_api_key_flag_requires_the_bearer_token(keyed_replica):
    assert_key_required(keyed_replica.url)


def test_api_key_from_the_environment_requires_the_bearer_token(spawn_replica):
    replica = spawn_replica("env-keyed", env={"DECODELAB_API_KEY": KEY}).wait_ready()
    assert_key_required(replica.url)


def test_a_request_bigger_than_the_kv_pool_gets_a_400_naming_max_tokens(keyed_replica):
    body = {**BODY, "max_tokens": 200}  # 128 token slots in all, far below the model's 2048-token context
    r = httpx.post(f"{keyed_replica.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=15)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("max_tokens:") and "pool" in message, message
