"""The playground in a real headless Chromium (Debian's, never `playwright install`) against real replicas."""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.helpers import ROOT
from tests.web.conftest import CHROMIUM
from web.spec_curve import expected_tokens

# the README's screenshot is refreshed on demand (DECODELAB_UPDATE_SCREENSHOT=1 make test), not by every run
SCREENSHOT = (ROOT / "docs" / "screenshot.png" if os.environ.get("DECODELAB_UPDATE_SCREENSHOT")
              else Path(tempfile.gettempdir()) / "decodelab-screenshot.png")
FINAL = ("done", "error", "cancelled", "invalid")
MODES = ("greedy", "beam", "sample", "speculative")

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (make test installs it)")


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Tab")


def open_playground(page, url: str, prompt: str) -> None:
    """Open the page once its replica shows, with a plain (no chat template) prompt."""
    page.goto(url)
    expect(page.locator("#dl-service")).to_contain_text("1 replica", timeout=10_000)
    page.locator("#prompt textarea").fill(prompt)
    page.locator("#chat input[type=checkbox]").uncheck()


def wait_columns_final(page, timeout_ms: int) -> dict[str, str]:
    page.wait_for_function(
        """([modes, final]) => modes.every(m => {
             const el = document.querySelector('#out-' + m + ' .dl-col');
             return el && final.includes(el.dataset.status); })""", arg=[list(MODES), list(FINAL)], timeout=timeout_ms)
    return {m: page.locator(f"#out-{m} .dl-col").get_attribute("data-status") for m in MODES}


def test_a_run_fills_all_four_columns_the_kv_panel_and_the_summary(smol_stack, page):
    web, _, _ = smol_stack
    page.goto(web.url)
    expect(page.locator("#dl-service")).to_contain_text("1 replica", timeout=10_000)
    expect(page.locator("#dl-service")).to_contain_text("(int8 weights, fp16 KV)")  # the precision the replica runs
    expect(page.locator("#proposer").get_by_text("draft", exact=True)).to_have_count(0)  # no draft model here
    # the example where speculation shines: the model repeats its context, the n-gram proposer drafts it
    page.locator("#examples").get_by_text("Speculation shines: repeat a text").click()
    expect(page.locator("#prompt textarea")).to_have_value(re.compile("^Repeat the following text exactly"))
    set_number(page, "max-tokens", 40)
    page.locator("#run").click()
    expect(page.locator("#out-greedy .dl-col")).to_have_attribute("data-status", re.compile("queued|running|done"))
    status = wait_columns_final(page, 150_000)
    assert status == dict.fromkeys(MODES, "done"), status

    for mode in ("greedy", "sample", "speculative"):
        values = page.locator(f"#out-{mode} .mts").first.locator(".mt b").all_inner_texts()
        ttft, tps, tpot, tokens, finish = values
        assert re.fullmatch(r"\d+ ms|\d+\.\d\d s", ttft) and float(tps) > 0 and int(tokens) > 0, values
        assert finish in ("stop", "length")
    assert page.locator("#out-speculative .tk.m-target, #out-speculative .tk.m-accepted").count() > 0
    expect(page.locator("#out-speculative .spec")).to_contain_text("vs greedy")
    # the replica's acceptance, exact, on the speed-up curve: high here, so several tokens per target forward
    curve = page.locator("#out-speculative .spec-curve")
    expect(curve.locator("svg circle.sc-dot")).to_be_visible()
    alpha, k = float(curve.get_attribute("data-alpha")), int(curve.get_attribute("data-k"))
    shown = page.locator("#out-speculative .spec > .mts .mt b").first.inner_text()
    assert shown == f"{alpha * 100:.0f}%" and k == 4  # the acceptance metric the column shows, placed on the curve
    assert alpha > 0.6, alpha
    assert float(curve.get_attribute("data-expected")) == pytest.approx(expected_tokens(alpha, k), abs=2e-3)
    assert float(curve.get_attribute("data-measured")) > 2.0
    assert page.locator("#out-beam .beam").count() == 3  # beams shown: 3 (the default)
    assert page.locator("#out-beam .txt .tk").count() > 0  # the best beam's text

    kv = page.locator("#kv")
    expect(kv).to_contain_text("prefix hits")
    assert kv.locator(".kt").count() == 8
    # the run's blocks, on the map (it is redrawn by the next pulse, which a loaded machine may delay)
    expect(kv.locator(".bmap i.u, .bmap i.sh").first).to_be_attached(timeout=10_000)
    expect(kv.locator(".hold").first).to_be_visible()
    expect(page.locator("#chart img")).to_be_visible(timeout=10_000)  # the summary (matplotlib)

    page.wait_for_timeout(1500)  # the next pulse: the counters show the replica at rest, the map the run's peak
    token = page.locator("#out-greedy .txt .tk").nth(3)
    token.hover()
    tip = token.locator(".tip")  # drawn from the token's data-* facts (web/tips.js)
    expect(tip).to_be_visible()
    expect(tip.locator(".alt").first).to_be_visible()
    expect(tip.locator(".alt.me")).to_have_count(1)  # greedy: the chosen token is among the top alternatives
    expect(tip.locator(".ent")).to_have_text(re.compile(r"entropy \d+\.\d\d nats"))
    assert re.search(r"p = \d+\.\d% \(logprob -?\d+\.\d\d\)", tip.text_content()), tip.text_content()
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    # Gradio's run history is off (web/app.py): it kept every run's outputs in localStorage and re-read them all
    # every 500 ms while a run streamed, so each run's page got slower and the prompts stayed in the browser
    stored = page.evaluate("() => Object.keys(localStorage).concat(Object.keys(sessionStorage))")
    assert not [k for k in stored if "run-history" in k], stored
    assert page.errors == []


def test_bad_input_shows_inline_errors_within_seconds(tiny_stack, page):
    web, _, _ = tiny_stack
    page.goto(web.url)
    page.locator("#run").click()
    expect(page.locator("#dl-message .dl-msg.error")).to_contain_text("Type a prompt", timeout=5_000)

    page.locator("#examples").get_by_text("Plain completion: primary colours").click()  # fills all three inputs
    expect(page.locator("#prompt textarea")).to_have_value("The three primary colours are")
    expect(page.locator("#chat input[type=checkbox]")).not_to_be_checked()
    set_number(page, "beam-width", 2)
    set_number(page, "beams-shown", 4)
    page.locator("#run").click()
    expect(page.locator("#out-beam .err")).to_contain_text("cannot exceed the beam width", timeout=10_000)
    expect(page.locator("#dl-message .dl-msg")).to_have_count(0)
    status = wait_columns_final(page, 30_000)
    assert status["beam"] == "invalid" and status["greedy"] == "done"
    assert page.errors == []


def tokens_shown(page) -> dict[str, int]:
    return {m: page.locator(f"#out-{m} .dl-col > .txt .tk").count() for m in MODES}


def test_run_during_a_run_replaces_it_and_stop_leaves_nothing_running(smol_stack, page):
    """Run while a long run streams starts the new run at once (its settings, its frames only) and stops the old
    one's requests; Run, Run, Stop leaves nothing to start after the Stop. Gradio's "always_last" deferred the
    second click to the end of the first run (30 s and more here), then ran it even after Stop."""
    web, _, _ = smol_stack
    open_playground(page, web.url, "Once upon a time, in a land far away, there lived a dragon who")
    set_number(page, "max-tokens", 1024)
    page.locator("#run").click()
    expect(page.locator("#out-greedy .dl-col > .txt .tk").nth(2)).to_be_attached(timeout=30_000)
    set_number(page, "max-tokens", 6)
    page.locator("#run").click()
    assert set(wait_columns_final(page, 20_000).values()) == {"done"}
    shown = tokens_shown(page)
    assert shown["greedy"] == 6 and shown["speculative"] == 6, shown
    expect(page.locator("#dl-service")).to_contain_text("0 running", timeout=10_000)  # the long run's too
    page.wait_for_timeout(1_000)
    assert tokens_shown(page) == shown  # no frame of the replaced run came after

    set_number(page, "max-tokens", 1024)
    page.locator("#run").click()
    page.locator("#run").click()
    expect(page.locator("#out-greedy .dl-col > .txt .tk").nth(2)).to_be_attached(timeout=30_000)
    page.locator("#stop").click()
    assert set(wait_columns_final(page, 10_000).values()) == {"cancelled"}
    expect(page.locator("#dl-service")).to_contain_text("0 running", timeout=10_000)
    page.wait_for_timeout(2_000)
    status = {m: page.locator(f"#out-{m} .dl-col").get_attribute("data-status") for m in MODES}
    assert status == dict.fromkeys(MODES, "cancelled"), status  # nothing started after the Stop
    assert page.errors == []


@pytest.mark.parametrize("which, pill, message", [
    ("engine_down_web", "No engine replica connected", "No engine replica is connected"),
    ("redis_down_web", "Redis unreachable", "Redis is unreachable"),
])
def test_engine_or_redis_down_is_visible_within_seconds(request, page, which, pill, message):
    web = request.getfixturevalue(which)
    page.goto(web.url)
    expect(page.locator("#dl-service")).to_contain_text(pill, timeout=5_000)
    page.locator("#prompt textarea").fill("Hello")
    page.locator("#run").click()
    expect(page.locator("#dl-message .dl-msg.error")).to_contain_text(message, timeout=5_000)
    assert page.errors == []


# an init script runs before the page's own: it sees the frame requests web/frames.js lets through, and which
# module asked (Gradio's status trackers are in its statustracker chunk)
COUNT_FRAMES_JS = """(() => {
  const frame = window.requestAnimationFrame.bind(window);
  window.__frames = {trackers: 0, others: 0};
  window.requestAnimationFrame = (callback) => {
    window.__frames[(new Error().stack || "").includes("/statustracker-") ? "trackers" : "others"]++;
    return frame(callback);
  };
})();"""


def test_gradios_status_trackers_ask_for_no_frames_on_an_idle_page(tiny_stack, page):
    """Gradio's status trackers time an event in a requestAnimationFrame loop, and the page's "Loading..." one
    is unmounted mid-loop at every load: 60 frames a second while the page sits idle (~120 in the two seconds
    below without web/frames.js, which web/head_first.py puts first in the page). The page still runs, and
    Gradio's other loops still get their frames."""
    web, _, _ = tiny_stack
    page.add_init_script(COUNT_FRAMES_JS)
    open_playground(page, web.url, "The capital of France is")
    assert page.evaluate("document.head.firstElementChild.textContent").lstrip().startswith("// The first script")
    set_number(page, "max-tokens", 4)
    page.locator("#run").click()
    assert set(wait_columns_final(page, 60_000).values()) == {"done"}
    page.wait_for_timeout(1_000)
    page.evaluate("window.__frames = {trackers: 0, others: 0}")
    page.wait_for_timeout(2_000)
    assert page.evaluate("window.__frames.trackers") == 0
    assert page.errors == []



def test_an_idle_page_sends_gradio_no_events_and_its_pulse_redraws_the_pill_and_the_kv_panel(tiny_stack, page):
    """The pill and the KV panel come from the page's pulse (web/pulse.js, GET dl/pulse once a second), not from a
    Gradio timer, whose every tick walked all the page's components (~5% of a core of an idle page's Chromium)."""
    web, _, _ = tiny_stack
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url))
    page.goto(web.url)
    expect(page.locator("#dl-service")).to_contain_text("1 replica", timeout=10_000)
    expect(page.locator("#kv")).to_contain_text("prefix hits")
    page.wait_for_timeout(1_000)
    del asked[:]
    for host in ("dl-service", "kv"):  # stale drawings: the pulse must draw over them
        page.evaluate("""(id) => [...document.getElementById(id).querySelectorAll('*')].find((e) => e.dlDraw)
                                   .dlDraw('<p class="stale">stale</p>')""", host)
    page.wait_for_timeout(3_000)
    pulses = [u for u in asked if "/dl/pulse?session=" in u]
    assert 2 <= len(pulses) <= 5, asked
    # no event: neither an unqueued call nor a queued one (the page's streams, a heartbeat, may still open late)
    assert [u for u in asked if "/gradio_api/run/" in u or "/gradio_api/queue/join" in u] == []
    expect(page.locator("#dl-service")).to_contain_text("1 replica")
    expect(page.locator("#kv")).to_contain_text("prefix hits")
    expect(page.locator(".stale")).to_have_count(0)
    assert page.errors == []
