"""The speculative column, draft against target, in a real headless Chromium against a real replica that serves a
tiny target with a tiny draft model (`--draft-model`, the same vocabulary): the draft check in a token's hover
card, the acceptance-by-draft-position bars, and the n-gram and draft proposers side by side."""
from __future__ import annotations

import json
import re
import uuid
from html import unescape

import pytest
from playwright.sync_api import expect

from shared.keys import Keys
from shared.protocol import DraftCheck, TokenEvent, TokenLogprob
from tests.engine.test_spec_decode import save_draft
from tests.replicas import Replica
from tests.web.conftest import TINY_KV_BLOCKS, WebApp
from tests.web.test_browser import open_playground, set_number, wait_columns_final
from tests.web.test_browser import pytestmark as needs_chromium
from web.columns import Column
from web.render import column_html

K = 3


# ---- the column and its HTML (no browser)
def _check(position: int, accepted: bool, residual: int | None = None) -> DraftCheck:
    return DraftCheck(position=position, draft_token_id=10 + position, draft_token=f"d{position}", p_draft=0.5,
                      p_target=0.25, accept_prob=0.5, accepted=accepted, residual_token_id=residual,
                      residual_token=None if residual is None else "y", residual_top=[(residual, "y", 0.8)]
                      if residual is not None else [])


def test_while_streaming_the_bars_count_the_checks_and_say_they_are_estimates():
    col = Column("speculative")
    # two rounds: one kept its first draft then rejected the second, one kept all three then took a bonus
    marks = ["target", "accepted", "resampled", "accepted", "accepted", "accepted", "bonus"]
    checks = [None, _check(0, True), _check(1, False, 7), _check(0, True), _check(1, True), _check(2, True), None]
    logprobs = [TokenLogprob(token_id=i, token=c, logprob=-1.0) for i, c in enumerate("abcdefg", 1)]
    col.feed(TokenEvent(request_id="r", seq=0, text_delta="abcdefg", token_ids=list(range(1, 8)), spec=marks,
                        drafts=checks, logprobs=logprobs))
    assert col.by_position(K) == ([2, 2, 2], [2, 1, 1], False)
    assert col.tokens_per_step() == 7 / 3  # three target forwards: the target token, the resampled, the bonus
    html = column_html(col, spec_k=K)
    assert 'data-exact="false"' in html and "≈ while streaming" in html
    # one draft check per checked token, in its data-d (web/tips.js draws the card on hover)
    checked = [json.loads(unescape(d)) for d in re.findall(r'data-d="([^"]*)"', html)]
    assert [c[2] for c in checked] == [True, False, True, True, True]  # accepted?
    assert [c[6] for c in checked] == [None, 7, None, None, None]  # the residual's token: only on the rejection


@pytest.fixture(scope="module")
def draft_stack(redis_server, tiny_llama_dir, tmp_path_factory):
    """(web app, replica) on the tiny model with a draft model that agrees with it often, not always."""
    draft = save_draft(tiny_llama_dir, tmp_path_factory.mktemp("web_draft"), noise=0.05)
    keys = Keys(f"web-spec-{uuid.uuid4().hex[:6]}")
    replica = Replica(tiny_llama_dir, redis_server.url, keys, "spec-1", "--num-kv-blocks", str(TINY_KV_BLOCKS),
                      "--max-num-seqs", "16", "--draft-model", str(draft), served="tiny")
    web = WebApp(redis_server.url, keys)
    try:
        replica.wait_ready()
        yield web, replica
    finally:
        web.close()
        replica.stop()


def _open(page, url: str) -> None:
    open_playground(page, url, "The capital of France is Paris. The capital of France is")


@needs_chromium
def test_the_draft_proposer_shows_its_checks_bars_and_the_ngram_proposer_beside_it(draft_stack, page):
    web, _ = draft_stack
    _open(page, web.url)
    compare = page.locator("#compare-proposers input[type=checkbox]")
    expect(compare).to_be_enabled()
    expect(page.locator("#compare-proposers")).to_contain_text("web_draft")  # the replica's draft model, named
    page.locator("#proposer").get_by_text("draft", exact=True).click()
    set_number(page, "spec-k", K)
    set_number(page, "max-tokens", 32)
    compare.check()
    page.locator("#run").click()
    status = wait_columns_final(page, 120_000)
    assert status["speculative"] == "done", status
    spec = page.locator("#out-speculative")

    cards = spec.locator(".proposers .pcard")
    expect(cards).to_have_count(2)
    for proposer in ("draft", "ngram"):
        card = spec.locator(f'.pcard[data-proposer="{proposer}"]')
        expect(card.locator(".pill")).to_have_class(re.compile("s-done"), timeout=60_000)
        expect(card.locator(".bypos .bp")).to_have_count(K)
        expect(card.locator(".mt", has_text="tok/step")).to_be_visible()
        expect(card.locator(".mt", has_text="TPOT")).to_be_visible()
    expect(spec.locator('.pcard[data-proposer="draft"] .bypos')).to_have_attribute("data-exact", "true")
    heights = spec.locator('.pcard[data-proposer="draft"] .bp .well i').evaluate_all(
        "els => els.map(e => parseFloat(e.style.height))")
    assert heights[0] > 0 and heights == sorted(heights, reverse=True), heights  # kept only after the ones before

    # hover cards: an accepted draft and a rejected one (the token in its place is the target's)
    accepted = spec.locator(".dl-col > .txt .tk.m-accepted").first
    accepted.hover()
    card = accepted.locator(".tip .dc")
    expect(card).to_be_visible()
    for text in ("p_draft q(x)", "p_target p(x)", "accept min(1, p/q)", "accepted"):
        expect(card).to_contain_text(text)
    resampled = spec.locator(".dl-col > .txt .tk.m-resampled").first
    resampled.hover()
    card = resampled.locator(".tip .dc")
    expect(card).to_be_visible()
    expect(card).to_contain_text("rejected")
    expect(card).to_contain_text("residual max(0, p − q)")
    expect(card.locator(".alt.me")).to_have_count(1)  # the greedy target's token: the residual's one token
    assert page.errors == []


@needs_chromium
def test_compare_proposers_is_disabled_with_a_note_without_a_draft_model(tiny_stack, page):
    web, _, _ = tiny_stack
    page.goto(web.url)
    expect(page.locator("#dl-service")).to_contain_text("1 replica", timeout=10_000)
    expect(page.locator("#compare-proposers input[type=checkbox]")).to_be_disabled()
    expect(page.locator("#compare-proposers")).to_contain_text("none has one")
    expect(page.locator("#proposer").get_by_text("draft", exact=True)).to_have_count(0)  # n-gram only
    expect(page.locator("#proposer")).to_contain_text("no replica has one")
    assert page.errors == []
