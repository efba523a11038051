"""The playground over several replicas, in a real headless Chromium: a run's four columns and its branches land on
one replica and hit its prefix cache exactly as they do with one replica (prefix-aware routing, shared/router.py)."""
from __future__ import annotations

import threading
import uuid

import redis
from playwright.sync_api import expect

from shared.keys import Keys
from shared.protocol import DoneEvent, decode_event
from tests.replicas import Replica
from tests.web.conftest import TINY_KV_BLOCKS, WebApp
from tests.web.test_branching import MAIN, texts
from tests.web.test_browser import pytestmark, set_number, wait_columns_final  # noqa: F401 (pytestmark: skip)

# cold in every stack's replicas: long enough for several full blocks, so prefix hits are visible
PROMPT = ("Routing test. Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
          "complex. Flat is better than nested. The capital of France is")


class Finished:
    """Every DoneEvent published under `keys` while it listens: request id -> (replica, cached prompt tokens)."""

    def __init__(self, url: str, keys: Keys):
        self.done: dict[str, tuple[str, int]] = {}
        self._pubsub = redis.Redis.from_url(url, decode_responses=True).pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(keys.events("*"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            msg = self._pubsub.get_message(timeout=0.1)
            if msg and isinstance(ev := decode_event(msg["data"]), DoneEvent):
                self.done[ev.request_id] = (ev.metrics.replica, ev.metrics.cached_prompt_tokens)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()


def run_and_branch(page, url: str, replicas: int) -> None:
    page.goto(url)
    expect(page.locator("#dl-service")).to_contain_text(f"{replicas} replica", timeout=15_000)
    page.locator("#prompt textarea").fill(PROMPT)
    page.locator("#chat input[type=checkbox]").uncheck()
    set_number(page, "max-tokens", 8)
    page.locator("#run").click()
    assert wait_columns_final(page, 90_000) == dict.fromkeys(("greedy", "beam", "sample", "speculative"), "done")
    root = texts(page)
    page.locator(f'{MAIN}[data-pos="3"]').click()  # a branch of the greedy column from its fourth token
    page.locator("#dl-pop .alt").nth(1).click()
    col = page.locator("#out-greedy .dl-col")
    expect(col).to_have_attribute("data-branch", "1", timeout=5_000)
    expect(col).to_have_attribute("data-status", "done", timeout=30_000)
    assert texts(page)[:3] == root[:3]


def test_a_run_and_its_branches_stay_on_one_replica_with_the_prefix_hits_of_one(redis_server, tiny_llama_dir,
                                                                                 page):
    hits = {}
    for n in (1, 3):  # (one replica, the baseline, and three: 2 added ~25 s to make test and nothing 3 misses)
        keys = Keys(f"web-routed-{n}-{uuid.uuid4().hex[:6]}")
        replicas = [Replica(tiny_llama_dir, redis_server.url, keys, f"r{n}-{i}", "--num-kv-blocks",
                            str(TINY_KV_BLOCKS), "--max-num-seqs", "16") for i in range(n)]
        web = WebApp(redis_server.url, keys)
        finished = Finished(redis_server.url, keys)
        try:
            for r in replicas:
                r.wait_ready()
            run_and_branch(page, web.url, n)
            assert page.errors == []
            page.goto("about:blank")  # before its server goes: the page would poll a closed port
            page.errors.clear()  # (leaving aborts the page's pending fetches: AbortError, not a fault of the run)
        finally:
            finished.close()
            web.close()
            for r in replicas:
                r.stop()
        done = finished.done
        assert len(done) == 5, done  # four columns and one branch
        assert len({replica for replica, _ in done.values()}) == 1, done  # all on one replica's cache
        hits[n] = sorted(cached for _, cached in done.values())
        assert sum(hits[n]) > 0, done  # the later columns and the branch found the prompt cached
    assert hits[3] == hits[1], hits
