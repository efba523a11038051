"""The probability trace (web/trace.py): the series it draws from a column's tokens (pure), and in a real headless
Chromium after a Run against a tiny-model replica, one chart with the four columns' lines equal to their tokens'."""
from __future__ import annotations

import json
import math
import re

import pytest
from playwright.sync_api import expect

from tests.web.test_browser import MODES, open_playground, set_number, wait_columns_final
from tests.web.test_browser import pytestmark as needs_chromium
from web.columns import Token
from web.render import ENTROPY_SCALE
from web.trace import Trace, trace_html


def tokens(logprobs: list[float | None], entropies: list[float | None]) -> list[Token]:
    return [Token(f"t{i}", i, lp, entropy=h) for i, (lp, h) in enumerate(zip(logprobs, entropies))]


def line(html: str, mode: str) -> dict[str, str]:
    tag = re.search(rf'<polyline class="tr-p" data-mode="{mode}"[^>]*>', html).group(0)
    return dict(re.findall(r'([\w-]+)="([^"]*)"', tag))


def test_a_column_s_series_is_its_tokens_probabilities_and_entropies():
    t = Trace.of("greedy", tokens([math.log(0.5), math.log(0.25), None], [1.0, 2.0, None]))
    assert t.p == pytest.approx([0.5, 0.25, None]) and t.entropy == [1.0, 2.0, None]
    assert t.mean_p() == pytest.approx(0.375) and t.mean_entropy() == pytest.approx(1.5)


def test_one_chart_overlays_a_line_and_a_band_per_column():
    traces = [Trace.of(m, tokens([math.log(0.9 - 0.1 * i)] * (4 + i), [0.5 * i] * (4 + i)))
              for i, m in enumerate(MODES)]
    html = trace_html(traces)
    assert html.count("<svg") == 1 and html.count('class="tr-p"') == 4 and html.count('class="tr-h"') == 4
    for i, m in enumerate(MODES):
        attrs = line(html, m)
        assert int(attrs["data-n"]) == 4 + i
        assert [float(p) for p in attrs["data-p"].split(",")] == pytest.approx([0.9 - 0.1 * i] * (4 + i), abs=1e-4)
    # the x axis spans the longest column: the last point of the longest line at the plot's right edge
    def xs(mode: str) -> list[float]:
        return [float(p.split(",")[0]) for p in line(html, mode)["points"].split()]
    assert xs(MODES[0])[0] == xs(MODES[-1])[0] and xs(MODES[0])[-1] < xs(MODES[-1])[-1]


def test_a_token_without_entropy_breaks_the_band_and_a_high_entropy_is_clipped():
    html = trace_html([Trace.of("beam", tokens([-0.1] * 5, [1.0, None, 2.0 * ENTROPY_SCALE, 3.0, 0.0]))])
    assert html.count('class="tr-h"') == 2  # [1.0] and [10.0, 3.0, 0.0]: two stretches
    assert 'data-mode="beam"' in html and "H 3.50" in html  # the legend's mean entropy, of the known values


def test_without_tokens_the_panel_says_what_it_will_show():
    assert "Run to see" in trace_html([]) and "<svg" not in trace_html([])
    assert "Waiting for the first tokens" in trace_html([Trace.of("greedy", [])], running=True)


@needs_chromium
def test_after_a_run_the_trace_draws_each_column_s_chosen_token_probabilities(tiny_stack, page):
    web, _, _ = tiny_stack
    open_playground(page, web.url, "Probability trace check: the quick brown fox")
    expect(page.locator("#trace")).to_contain_text("Run to see")
    set_number(page, "max-tokens", 12)
    page.locator("#run").click()
    status = wait_columns_final(page, 60_000)
    assert status == dict.fromkeys(MODES, "done"), status

    chart = page.locator("#trace svg.tr-plot")
    expect(chart).to_have_count(1)
    expect(chart.locator("polyline.tr-p")).to_have_count(4)
    assert chart.locator("polygon.tr-h").count() >= 4  # an entropy band per column (every token has an entropy)
    for mode in MODES:
        shown = page.evaluate("""(m) => [...document.querySelectorAll('#out-' + m + ' .dl-col > .txt .tk')]
                                   .map(t => [+t.dataset.lp, JSON.parse(t.dataset.alts)])""", mode)
        drawn = chart.locator(f'polyline.tr-p[data-mode="{mode}"]')
        p = [float(v) for v in drawn.get_attribute("data-p").split(",")]
        assert len(p) == len(shown) > 0, mode
        assert p == pytest.approx([math.exp(lp) for lp, _ in shown], abs=2e-4), mode
        if mode in ("greedy", "speculative"):  # temperature 0: every chosen token tops its distribution
            assert p == pytest.approx([max(a[2] for a in alts) for _, alts in shown], abs=2e-4), mode
        expect(page.locator(f'#trace .rl-legend span[data-mode="{mode}"]')).to_contain_text("mean p")
    # the lines are drawn inside the plot: every point within the viewBox
    for pts in chart.locator("polyline.tr-p").evaluate_all("els => els.map(e => e.getAttribute('points'))"):
        for xy in pts.split():
            x, y = map(float, xy.split(","))
            assert 0 <= x <= 720 and 0 <= y <= 200
    assert page.errors == []


@needs_chromium
def test_the_trace_follows_the_branch_a_column_shows(tiny_stack, page):
    from tests.web.test_branching import MAIN, run_raw_prompt

    web, _, _ = tiny_stack
    run_raw_prompt(page, web.url, 10)
    assert wait_columns_final(page, 60_000)["greedy"] == "done"
    drawn = page.locator('#trace polyline.tr-p[data-mode="greedy"]')

    def probabilities() -> list[float]:
        return [float(v) for v in drawn.get_attribute("data-p").split(",")]

    root = probabilities()
    alts = json.loads(page.locator(f'{MAIN}[data-pos="3"]').get_attribute("data-alts"))
    page.locator(f'{MAIN}[data-pos="3"]').click()
    page.locator("#dl-pop .alt").nth(1).click()  # branch with the second likeliest token at position 3
    col = page.locator("#out-greedy .dl-col")
    expect(col).to_have_attribute("data-branch", "1", timeout=5_000)
    expect(col).to_have_attribute("data-status", "done", timeout=30_000)
    page.wait_for_function("(n) => document.querySelector('#trace polyline.tr-p[data-mode=\"greedy\"]')"
                           ".dataset.n == n", arg=page.locator(MAIN).count(), timeout=10_000)
    branch = probabilities()
    assert branch[:3] == root[:3]  # the inherited tokens
    assert branch[3] == pytest.approx(alts[1][2], abs=2e-4) and branch[3] < root[3]  # the picked one, less likely
    page.locator('#out-greedy .dl-tree .tb[data-branch="0"]').click()
    expect(col).to_have_attribute("data-branch", "0", timeout=2_000)
    expect(drawn).to_have_attribute("data-n", str(len(root)), timeout=5_000)
    assert probabilities() == root
    assert page.errors == []
