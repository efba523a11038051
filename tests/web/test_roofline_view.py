"""The "Engine steps" panel (web/roofline.py): what its summary says of a set of steps (pure), and in a real headless
Chromium after a Run against a tiny-model replica, the run's steps on the replica's roofline."""
from __future__ import annotations

import pytest
from playwright.sync_api import expect

from shared.monitor import StepRecord
from tests.web.test_browser import MODES, set_number, wait_columns_final
from tests.web.test_browser import pytestmark as needs_chromium
from web.roofline import Summary, kind_of, roofline_html

ROOFS = {"kind": "float32", "flops_per_s": 100e9, "bytes_per_s": 10e9, "matmul_flops_per_s": 100e9}


def step(n: int, prefill: int, decode: int, seqs: int, seconds: float, flops: float, nbytes: float) -> StepRecord:
    return StepRecord(step=n, start=0.0, seconds=seconds, prefill_tokens=prefill, decode_tokens=decode,
                      num_seqs=seqs, request_ids=["r"], flops=int(flops), bytes=int(nbytes))


STEPS = [step(1, 64, 0, 1, 0.01, 0.5e9, 0.05e9),  # 50 GFLOP/s: half the compute roof
         step(2, 0, 1, 1, 0.01, 0.01e9, 0.08e9),  # decode alone: 8 GB/s of 10, 0.125 FLOP/byte
         step(3, 3, 1, 2, 0.01, 0.05e9, 0.05e9),  # mixed: in neither figure
         step(4, 0, 4, 4, 0.01, 0.04e9, 0.06e9),  # decode of 4: 6 GB/s, 0.67 FLOP/byte
         step(5, 0, 4, 4, 0.03, 0.04e9, 0.06e9)]  # the same, slower: 2 GB/s (together with step 4: 3 GB/s)
RIGHT_OF_RIDGE = [step(1, 0, 1, 1, 0.01, 0.01e9, 0.05e9), step(2, 0, 64, 64, 0.01, 0.6e9, 0.05e9)]


def test_steps_are_prefill_decode_or_mixed_by_their_tokens():
    assert [kind_of(s) for s in STEPS] == ["prefill", "decode", "mixed", "decode", "decode"]


def test_the_summary_gives_each_kind_its_share_of_the_roof_that_bounds_it():
    s = Summary.of(STEPS, ROOFS)
    assert s.prefill_compute == pytest.approx(0.5) and s.ridge == 10
    assert [(d.seqs, d.bound) for d in s.decode] == [(1, "memory"), (4, "memory")]
    assert [d.share for d in s.decode] == pytest.approx([0.8, 0.3])  # bytes / time / the memory roof
    assert [d.intensity for d in s.decode] == pytest.approx([0.125, 2 / 3])
    text = s.html()
    assert "prefill</b>: 50% of the compute roof" in text
    assert "80% of the memory roof at 1 sequence (0.12 FLOP/byte) → 30% of the memory roof at 4 sequences" in text


def test_decode_batched_past_the_ridge_is_measured_against_the_compute_roof():
    s = Summary.of(RIGHT_OF_RIDGE, ROOFS)
    assert [(d.seqs, d.bound) for d in s.decode] == [(1, "memory"), (64, "compute")]
    assert s.decode[1].share == pytest.approx(0.6) and s.prefill_compute is None
    assert "60% of the compute roof at 64 sequences (12 FLOP/byte)" in s.html()


def test_without_steps_the_panel_says_what_it_will_show():
    assert "Run to see" in roofline_html({}, {})
    assert "Waiting for the engine" in roofline_html({"r1": []}, {}, running=True)


def test_a_replica_without_roofs_still_gets_its_strip():
    html = roofline_html({"old": STEPS}, {})
    assert "published no roofs" in html and "rl-strip" in html and "rl-plot" not in html


@needs_chromium
def test_after_a_run_the_panel_plots_its_prefill_and_decode_steps_under_the_roofs(tiny_stack, page):
    web, replica, _ = tiny_stack
    page.goto(web.url)
    expect(page.locator("#dl-service")).to_contain_text("1 replica", timeout=10_000)
    expect(page.locator("#steps")).to_contain_text("Run to see")
    page.locator("#prompt textarea").fill("Roofline check: a prompt long enough to prefill in one go.")
    set_number(page, "max-tokens", 12)
    page.locator("#run").click()
    status = wait_columns_final(page, 60_000)
    assert status == dict.fromkeys(MODES, "done"), status

    panel = page.locator("#steps .rl-rep")
    expect(panel).to_have_count(1, timeout=10_000)
    expect(panel.locator(".kv-title")).to_contain_text(replica.name)
    plot = panel.locator("svg.rl-plot")
    expect(plot.locator("polyline.roof")).to_have_count(1)  # the memory slope, the ridge, the compute roof
    expect(plot).to_contain_text("compute roof")
    expect(plot).to_contain_text("memory roof")
    assert plot.locator("circle.pt.prefill").count() >= 1  # greedy's prompt, alone (the others share it)
    assert plot.locator("circle.pt.decode").count() >= 1
    expect(panel.locator(".rl-sum")).to_contain_text("of the compute roof")
    expect(panel.locator(".rl-sum")).to_contain_text("of the memory roof")
    # one bar group per step in the strip, as many as dots (no step drawn twice)
    assert panel.locator("svg.rl-strip g").count() == plot.locator("circle.pt").count()
    # a prefill dot sits right of the leftmost decode dot (greedy decoding alone): a higher arithmetic intensity
    xs = page.evaluate("""() => {
        const dots = [...document.querySelectorAll('#steps circle.pt')];
        const cx = (k) => dots.filter(d => d.classList.contains(k)).map(d => +d.getAttribute('cx'));
        return {prefill: cx('prefill'), decode: cx('decode')}; }""")
    assert max(xs["prefill"]) > min(xs["decode"])
    assert page.errors == []
