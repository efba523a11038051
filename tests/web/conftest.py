"""Web fixtures: a real redis-server, real engine replicas (`decodelab engine` subprocesses), the playground in-process.

Two stacks share one Redis under different key prefixes: a tiny random model (fast, exact checks against the
in-process engine) and SmolLM2 (real text, for the browser test and its screenshot).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import httpx  # noqa: E402
import pytest  # noqa: E402

from engine_service.redis_server import RedisServer, die_with_parent, free_port  # noqa: E402
from shared.keys import Keys  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY_KV_BLOCKS = 256


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (value := predicate()):
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Replica:
    """`decodelab engine` as a subprocess in its own process group."""

    def __init__(self, model: str, redis_url: str, keys: Keys, name: str, served: str, *extra: str):
        self.name, self.port = name, free_port()
        env = dict(os.environ, REDIS_URL=redis_url, DECODELAB_REDIS_PREFIX=keys.prefix, OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
        argv = [sys.executable, "-m", "engine_service.cli", "engine", "--model", model, "--threads", "1",
                "--port", str(self.port), "--replica-name", name, "--served-model-name", served,
                "--log-level", "warning", "--drain-timeout", "1", *extra]
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True, preexec_fn=die_with_parent)

    def wait_ready(self, timeout: float = 120.0) -> Replica:
        def ready() -> bool:
            assert self.proc.poll() is None, f"replica {self.name} exited with {self.proc.returncode}"
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, 0.2, f"replica {self.name} ready")
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class WebApp:
    """The playground launched in this process (its own server thread) against `redis_url` / `keys`."""

    def __init__(self, redis_url: str, keys: Keys, **service_kw):
        from web.app import build_app, launch
        from web.session import Service

        self.demo = build_app(Service(redis_url, keys, **service_kw))
        self.port = free_port()
        launch(self.demo, "127.0.0.1", self.port, prevent_thread_lock=True, quiet=True)
        self.url = f"http://127.0.0.1:{self.port}/"

    def close(self) -> None:
        self.demo.close()


@pytest.fixture(scope="session")
def redis_server():
    with RedisServer() as server:
        yield server


def _keys(name: str) -> Keys:
    return Keys(f"web-{name}-{uuid.uuid4().hex[:6]}")


@pytest.fixture(scope="session")
def tiny_stack(redis_server, tiny_llama_dir):
    """(web app, replica, keys) on the tiny model; the replica starts while the caller loads other things."""
    keys = _keys("tiny")
    replica = Replica(str(tiny_llama_dir), redis_server.url, keys, "tiny-1", "tiny",
                      "--num-kv-blocks", str(TINY_KV_BLOCKS), "--max-num-seqs", "16")
    web = WebApp(redis_server.url, keys)
    try:
        replica.wait_ready()
        yield web, replica, keys
    finally:
        web.close()
        replica.stop()


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_dir):
    from engine_service.llm import LLM

    return LLM(str(tiny_llama_dir), num_kv_blocks=TINY_KV_BLOCKS, max_num_seqs=16)


@pytest.fixture(scope="session")
def smol_stack(redis_server, smollm2_dir):
    keys = _keys("smol")
    replica = Replica(str(smollm2_dir), redis_server.url, keys, "smollm2-1", "smollm2-135m",
                      "--num-kv-blocks", "512", "--max-num-seqs", "16")
    web = WebApp(redis_server.url, keys)
    try:
        replica.wait_ready()
        yield web, replica, keys
    finally:
        web.close()
        replica.stop()


@pytest.fixture(scope="session")
def engine_down_web(redis_server):
    """The playground on a Redis namespace that no replica serves."""
    web = WebApp(redis_server.url, _keys("down"))
    yield web
    web.close()


@pytest.fixture(scope="session")
def redis_down_web():
    """The playground pointed at a port where nothing listens."""
    web = WebApp(f"redis://:nopass@127.0.0.1:{free_port()}/0", _keys("noredis"))
    yield web
    web.close()
