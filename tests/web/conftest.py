"""Web fixtures: a real redis-server, real engine replicas (`decodelab engine` subprocesses), the playground in-process.

Two stacks share the session's Redis (tests/conftest.py) under different key prefixes: a tiny random model
(fast, exact checks against the in-process engine) and SmolLM2 (real text, for the browser test and its screenshot).
"""
from __future__ import annotations

import os
import tempfile
import uuid

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import pytest  # noqa: E402

from engine_service.server.redis_server import free_port  # noqa: E402
from shared.keys import Keys  # noqa: E402
from tests.replicas import Replica  # noqa: E402

TINY_KV_BLOCKS = 256
CHROMIUM = "/usr/bin/chromium"  # Debian's, never `playwright install`
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


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


def _keys(name: str) -> Keys:
    return Keys(f"web-{name}-{uuid.uuid4().hex[:6]}")


def _stack(redis_url: str, model, served: str, name: str, kv_blocks: int, *extra: str):
    """A replica of `model` and the playground on a fresh key prefix; the replica loads while the web starts."""
    keys = _keys(served.split("-")[0])
    replica = Replica(model, redis_url, keys, name, "--num-kv-blocks", str(kv_blocks), "--max-num-seqs", "16",
                      *extra, served=served)
    web = WebApp(redis_url, keys)
    try:
        replica.wait_ready()
        yield web, replica, keys
    finally:
        web.close()
        replica.stop()


@pytest.fixture(scope="session")
def tiny_stack(redis_server, tiny_llama_dir):
    """(web app, replica, keys) on the tiny model; the replica starts while the caller loads other things."""
    yield from _stack(redis_server.url, tiny_llama_dir, "tiny", "tiny-1", TINY_KV_BLOCKS)


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_dir):
    from engine_service.engine.llm import LLM

    return LLM(str(tiny_llama_dir), num_kv_blocks=TINY_KV_BLOCKS, max_num_seqs=16)


@pytest.fixture(scope="session")
def smol_stack(redis_server, smollm2_dir):
    """SmolLM2 as `decodelab play` serves it on a CPU: int8 weights."""
    yield from _stack(redis_server.url, smollm2_dir, "smollm2-135m", "smollm2-1", 512, "--quantization", "int8")


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


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium with a fresh profile (the browser tests skip where it is missing)."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="decodelab-chromium-") as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=ARGS,
                                                    viewport={"width": 1600, "height": 1000})
        ctx.set_default_timeout(15_000)
        yield ctx
        ctx.close()


@pytest.fixture
def page(browser):
    """A new tab that records console errors and page errors in `page.errors`."""
    page = browser.new_page()
    page.errors = []
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    yield page
    page.close()
