"""Prefill/decode disaggregation seen in the playground, in a real headless Chromium: every column names the prefill
and the decode replica and the hand-over, and the KV panel and the engine-steps chart show both replicas."""
from __future__ import annotations

import uuid

from playwright.sync_api import expect

from shared.keys import Keys
from tests.replicas import Replica
from tests.web.conftest import TINY_KV_BLOCKS, WebApp
from tests.web.test_browser import MODES, pytestmark, set_number, wait_columns_final  # noqa: F401 (pytestmark: skip)
from tests.web.test_routed_playground import PROMPT


def test_a_disaggregated_run_shows_both_replicas_and_the_hand_over(redis_server, tiny_llama_dir, page):
    keys = Keys(f"web-pd-{uuid.uuid4().hex[:6]}")
    replicas = [Replica(tiny_llama_dir, redis_server.url, keys, name, "--role", role, "--num-kv-blocks",
                        str(TINY_KV_BLOCKS), "--max-num-seqs", "16") for name, role in (("pre", "prefill"),
                                                                                        ("dec", "decode"))]
    web = WebApp(redis_server.url, keys)
    try:
        for r in replicas:
            r.wait_ready()
        page.goto(web.url)
        expect(page.locator("#dl-service")).to_contain_text("2 replicas", timeout=15_000)
        page.locator("#prompt textarea").fill(PROMPT)
        page.locator("#chat input[type=checkbox]").uncheck()
        set_number(page, "max-tokens", 8)
        page.locator("#run").click()
        assert wait_columns_final(page, 90_000) == dict.fromkeys(MODES, "done")
        for mode in MODES:
            pill = page.locator(f"#out-{mode} .pill").first
            expect(pill).to_contain_text("pre → dec")
            assert "KV blocks" in pill.get_attribute("title") and "handed over" in pill.get_attribute("title")
        # the prefill steps on one replica, the decode steps on the other
        expect(page.locator("#steps .rl-rep")).to_have_count(2, timeout=10_000)
        titles = page.locator("#steps .rl-rep .kv-title").all_inner_texts()
        assert any("pre" in t for t in titles) and any("dec" in t for t in titles), titles
        expect(page.locator("#kv")).to_contain_text("pre")
        expect(page.locator("#kv")).to_contain_text("dec")
        assert page.errors == []
        page.goto("about:blank")
    finally:
        web.close()
        for r in replicas:
            r.stop()
