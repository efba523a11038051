"""Service fixtures: the real engine on a tiny model, workers, replicas (the Redis server is tests/conftest.py's)."""
from __future__ import annotations

import argparse
import os
import signal
import threading
import uuid

import httpx
import pytest
import redis
import uvicorn
from prometheus_client import CollectorRegistry

from engine_service.server.redis_server import free_port
from shared.keys import Keys
from tests.helpers import run, wait_until  # noqa: F401  (test_api.py and test_worker.py import them from here)
from tests.replicas import Replica

# Torch threads as OMP_NUM_THREADS says (the engine would otherwise take every core; 2 are shared here).
ENGINE_KW = dict(num_kv_blocks=512, max_num_seqs=16, block_size=16,
                 num_threads=int(os.environ.get("OMP_NUM_THREADS", 1)))


@pytest.fixture
def keys() -> Keys:
    return Keys(f"test-{uuid.uuid4().hex[:8]}")  # a fresh namespace per test on the shared server


@pytest.fixture
def sync_redis(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield r
    r.close()


@pytest.fixture(scope="session")
def engine(tiny_llama_dir):
    from engine_service.engine.config import EngineConfig
    from engine_service.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), **ENGINE_KW))


@pytest.fixture(scope="session")
def reference_engine(tiny_llama_dir):
    """A second engine on the same model, driven in-process: the expected outputs."""
    from engine_service.engine.llm import LLM

    return LLM(str(tiny_llama_dir), **ENGINE_KW)


@pytest.fixture
def make_worker(engine, redis_server, keys):
    from engine_service.server.config import ReplicaConfig
    from engine_service.server.replica import Replica

    workers = []

    def make(url: str | None = None, metrics=None, **kw):
        kw.setdefault("claim_idle_s", 2.0)
        w = Replica(engine, ReplicaConfig(url or redis_server.url, keys=keys, model_name="tiny", **kw), metrics).start()
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.stop()
    for rid in list(engine.requests):  # leave the shared engine idle for the next test
        engine.abort(rid)
    assert not engine.has_unfinished()


@pytest.fixture
def worker(make_worker):
    return make_worker()


@pytest.fixture
def spawn_replica(tiny_llama_dir, redis_server, keys):
    replicas: list[Replica] = []

    def spawn(name: str, *extra: str, redis_url: str | None = None, **kw) -> Replica:
        replica = Replica(tiny_llama_dir, redis_url or redis_server.url, keys, name,
                          "--num-kv-blocks", str(ENGINE_KW["num_kv_blocks"]), "--max-num-seqs", "4",
                          "--claim-idle", str(kw.pop("claim_idle", 1.5)), *extra, **{"drain_timeout": 2, **kw})
        replicas.append(replica)
        return replica

    yield spawn
    for r in replicas:
        r.kill(signal.SIGTERM if r.proc.poll() is None else signal.SIGKILL)


@pytest.fixture
def api(make_worker, redis_server, keys):
    """The replica's FastAPI app under a real uvicorn, in-process, over the in-process worker: (state, http)."""
    from engine_service.server.api.app import create_app
    from engine_service.server.api.state import ServiceState
    from engine_service.server.metrics import ReplicaMetrics
    from shared.client import EngineClient

    registry = CollectorRegistry()
    state = ServiceState("tiny", EngineClient(redis_server.url, keys), registry, drain_timeout=2)
    state.replica = make_worker(metrics=ReplicaMetrics(registry))
    yield from _serve(create_app(state), state)


@pytest.fixture
def api_front(make_worker, redis_server, keys):
    """`decodelab api`'s app (no engine in it) under a real uvicorn, in-process, and a worker: (state, http)."""
    from engine_service.server.api.app import create_app
    from engine_service.server.api.state import ServiceState
    from shared.client import EngineClient

    make_worker()
    state = ServiceState("tiny", EngineClient(redis_server.url, keys), CollectorRegistry(), drain_timeout=2,
                         front=True)
    yield from _serve(create_app(state, preload_tokenizer=True), state)


def _serve(app, state):
    from engine_service.server.engine_cmd import http_config

    port = free_port()
    args = argparse.Namespace(host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(http_config(app, args))  # the HTTP stack `engine` and `api` serve on
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 20, what="uvicorn started")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        yield state, http
    server.should_exit = True
    thread.join(20)
