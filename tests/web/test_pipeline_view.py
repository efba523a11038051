"""The sampler pipeline in the playground: the request asks only with the box ticked, the tokens carry the
engine's stages, and in a real headless Chromium against a real replica a clicked token shows them (equal to the
in-process engine's) with a what-if that reshapes them in the page."""
from __future__ import annotations

import json
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from playwright.sync_api import expect

from engine_service.engine.sampling_params import SamplingParams
from shared.protocol import SamplerStage, TokenEvent, TokenLogprob
from tests.web.test_branching import PROMPT
from tests.web.test_browser import pytestmark as needs_chromium
from tests.web.test_browser import set_number, wait_columns_final
from web.columns import Column
from web.modes import PIPELINE_TOKENS, Settings, build_request
from web.pipeline import SHOWN
from web.render import column_html

SAMPLED = "#out-sample .dl-col > .txt .tk"


def test_sampling_asks_for_the_pipeline_only_with_the_box_ticked():
    on, off = Settings(prompt="x", pipeline=True), Settings(prompt="x")
    for mode in ("greedy", "beam", "sample", "speculative"):
        want = PIPELINE_TOKENS if mode == "sample" else 0
        assert build_request(mode, on).params.sampler_stages == want, mode
        assert build_request(mode, off).params.sampler_stages == 0, mode


class _DataS(HTMLParser):
    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.found += [v for k, v in attrs if k == "data-s"]


def test_a_traced_token_carries_its_stages_into_the_html_and_an_untraced_one_nothing():
    tricky = "it's \"<b>&\""  # quotes and markup in a token's text survive the attribute
    raw = SamplerStage(name="raw", top=[(5, tricky, 0.61234)] + [(i, f"t{i}", 0.01) for i in range(6, 16)], kept=90,
                       removed=0.0, other=0.28766, chosen_rank=0, chosen_prob=0.61234)
    cut = SamplerStage(name="top_k", top=raw.top, kept=11, removed=0.28, other=0.0, chosen_rank=0, chosen_prob=0.85)
    col = Column("sample")
    lp = TokenLogprob(token_id=5, token=tricky, logprob=-0.49, top=[(5, tricky, -0.49)])
    col.feed(TokenEvent(request_id="r", seq=0, text_delta=tricky * 2, token_ids=[5, 5], logprobs=[lp, lp],
                        stages=[[raw, cut], [raw, cut]]))
    assert [t.stages for t in col.outputs[0].tokens] == [[raw, cut], [raw, cut]]
    parser = _DataS()
    parser.feed(column_html(col))
    assert len(parser.found) == 2
    drawn = json.loads(parser.found[0])
    assert drawn[0][:6] == ["raw", 90, 0.0, 0.2877, 0, 0.6123] and drawn[0][6][0] == [5, tricky, 0.6123]
    assert len(drawn[0][6]) == 11 and len(drawn[1][6]) == SHOWN  # the what-if's base whole, the others' head
    plain = Column("sample")
    plain.feed(TokenEvent(request_id="r", seq=0, text_delta="hi", token_ids=[5]))
    assert "data-s=" not in column_html(plain)


@needs_chromium
def test_a_sampled_token_shows_its_pipeline_equal_to_the_engine_s_and_a_what_if(tiny_stack, tiny_reference, page):
    web, _, _ = tiny_stack
    page.goto(web.url)
    expect(page.locator("#dl-service")).to_contain_text("1 replica", timeout=10_000)
    page.locator("#prompt textarea").fill(PROMPT)
    page.locator("#chat input[type=checkbox]").uncheck()
    page.locator("#sampler-pipeline input[type=checkbox]").check()
    set_number(page, "max-tokens", 6)
    page.locator("#run").click()
    assert wait_columns_final(page, 60_000)["sample"] == "done"
    s = Settings()
    ref = tiny_reference.generate([PROMPT], SamplingParams(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=s.seed, max_tokens=6,
        logprobs=5, mode="sample", sampler_stages=PIPELINE_TOKENS))[0].outputs[0]
    shown = page.evaluate(f"() => [...document.querySelectorAll('{SAMPLED}')].map(t => +t.dataset.id)")
    assert shown == ref.token_ids

    page.locator(f'{SAMPLED}[data-pos="2"]').click()
    pop = page.locator("#dl-pop .dl-pipe")
    expect(pop).to_be_visible()
    stages = pop.locator(".stage")
    want = ref.stages[2]
    expect(stages).to_have_count(len(want))
    drawn = stages.evaluate_all("els => els.map(e => ({...e.dataset}))")
    assert [d["stage"] for d in drawn] == [w["name"] for w in want] == ["raw", "temperature", "top_k", "top_p"]
    for d, w in zip(drawn, want):
        assert int(d["kept"]) == w["kept"] and int(d["rank"]) == w["chosen_rank"]
        assert float(d["p"]) == pytest.approx(w["chosen_prob"], abs=1e-4)
        assert float(d["removed"]) == pytest.approx(w["removed"], abs=1e-4)
    expect(stages.nth(0).locator(".bar.me")).to_have_count(1 if want[0]["chosen_rank"] < 5 else 0)
    assert page.locator("#dl-pop button.alt").count() == 5  # branching still offers its alternatives below

    result = pop.locator(".whatif .wr")
    set_knob = "([name, v]) => { const i = document.querySelector(`#dl-pop .whatif input[name=${name}]`); " \
               "i.value = v; i.dispatchEvent(new Event('input')); }"
    for name, value in (("t", 1), ("k", -1), ("p", 1), ("min_p", 0)):  # neutral: the raw stage itself
        page.evaluate(set_knob, [name, value])
    raw = want[0]
    assert int(result.get_attribute("data-kept")) == raw["kept"]
    if raw["chosen_rank"] < PIPELINE_TOKENS:  # exact within the top-N
        assert float(result.get_attribute("data-p")) == pytest.approx(raw["chosen_prob"], abs=1e-4)
    page.evaluate(set_knob, ["k", 1])  # top-1: the most likely token takes it all
    assert int(result.get_attribute("data-kept")) == 1
    expect(result.locator(".bar span").first).to_have_text("100.0%")
    page.locator("#dl-pop").screenshot(path=str(Path(tempfile.gettempdir()) / "decodelab-pipeline.png"))
    assert page.errors == []
