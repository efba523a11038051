"""The constraint control: one `structured_outputs` for all four columns (pure request building), and in a real
headless Chromium against the tiny random model, where only the grammar keeps the text to the choices."""
from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from tests.web.test_browser import MODES, open_playground, set_number, wait_columns_final
from tests.web.test_browser import pytestmark as needs_chromium
from web.modes import InputError, Settings, build_request

CHOICES = ["yes", "no", "maybe"]
MAIN_JS = """(mode) => [...document.querySelectorAll('#out-' + mode + ' .dl-col > .txt .tk')].map(s => {
    const c = s.cloneNode(true); c.querySelectorAll('.tip').forEach(t => t.remove()); return c.textContent; })"""


def _answer(page, mode: str) -> str:
    """A column's main text, without the stop token the column shows last when the grammar ended the text."""
    tokens = page.evaluate(MAIN_JS, mode)
    if tokens and re.fullmatch(r"<\|[^|]+\|>|</s>", tokens[-1]):
        tokens = tokens[:-1]
    return "".join(tokens)


def _requests(**kw) -> list:
    s = Settings(prompt="Pick one.", **kw)
    return [build_request(m, s) for m in MODES]


# ---- request building (pure)
def test_none_sends_no_structured_outputs():
    for r in _requests():
        assert r.params.structured_outputs is None
        assert "structured_outputs" not in r.params.model_dump(exclude_unset=True)


@pytest.mark.parametrize(("kind", "text", "want"), [
    ("choice", "yes\n  no \n\nmaybe\n", {"choice": CHOICES}),
    ("regex", "[0-9]{3}-[a-z]+", {"regex": "[0-9]{3}-[a-z]+"}),
    ("JSON schema", '{"type": "object", "properties": {"age": {"type": "integer"}}}',
     {"json": {"type": "object", "properties": {"age": {"type": "integer"}}}}),
])
def test_every_column_carries_the_same_constraint(kind, text, want):
    requests = _requests(constraint_type=kind, constraint=text)
    dumped = [r.params.structured_outputs.model_dump(exclude_defaults=True) for r in requests]
    assert dumped == [want] * 4
    assert [r.params.mode for r in requests] == list(MODES)  # the rest of each request is its mode's own


@pytest.mark.parametrize(("kind", "text", "why"), [
    ("JSON schema", '{"type": "object",', "not valid JSON"),
    ("JSON schema", "[1, 2]", "is an object"),
    ("regex", "   ", "empty"),
    ("choice", "\n\n", "empty"),
])
def test_a_malformed_constraint_is_an_input_error(kind, text, why):
    for mode in MODES:
        with pytest.raises(InputError, match=why):
            build_request(mode, Settings(prompt="x", constraint_type=kind, constraint=text))


# ---- in the browser
def _run(page, kind: str, text: str, max_tokens: int) -> None:
    """Set the constraint and Run."""
    accordion = page.locator("#constraint")
    if not page.locator("#constraint-text textarea").is_visible():
        accordion.get_by_text("Constraint (structured output", exact=False).first.click()
    page.locator("#constraint-type").get_by_text(kind, exact=True).click()
    page.locator("#constraint-text textarea").fill(text)
    set_number(page, "max-tokens", max_tokens)
    page.locator("#run").click()


def _open(page, url: str) -> None:
    open_playground(page, url, "The answer is")


@needs_chromium
def test_a_choice_constraint_holds_in_every_column(tiny_stack, page):
    web, _, _ = tiny_stack
    _open(page, web.url)
    _run(page, "choice", "\n".join(CHOICES), 8)
    status = wait_columns_final(page, 90_000)
    assert status == dict.fromkeys(MODES, "done"), status
    for mode in MODES:
        text = _answer(page, mode)
        assert text in CHOICES, (mode, text)  # 8 tokens are enough for any of them: the grammar ended each
    assert page.errors == []


@needs_chromium
def test_an_invalid_regex_shows_an_error_in_the_columns_and_a_later_run_works(tiny_stack, page):
    web, _, _ = tiny_stack
    _open(page, web.url)
    _run(page, "regex", "([", 8)
    status = wait_columns_final(page, 90_000)
    assert status == dict.fromkeys(MODES, "error"), status
    for mode in MODES:
        expect(page.locator(f"#out-{mode} .err")).to_contain_text("structured_outputs")

    _run(page, "regex", "(ab|cd)+", 6)
    for mode in MODES:  # from "error" (the last run) to "done": this run's own final state
        expect(page.locator(f"#out-{mode} .dl-col")).to_have_attribute("data-status", "done", timeout=90_000)
    for mode in MODES:
        text = _answer(page, mode)
        assert re.fullmatch(r"(ab|cd)+[ac]?", text), (mode, text)  # 6 tokens may cut the last pair, nothing else
    expect(page.locator("#out-greedy .err")).to_have_count(0)
    assert page.errors == []


@needs_chromium
def test_the_json_schema_example_fills_and_opens_the_constraint(tiny_stack, page):
    web, _, _ = tiny_stack
    page.goto(web.url)
    page.locator("#examples").get_by_text("JSON schema: a person").click()
    box = page.locator("#constraint-text textarea")
    expect(box).to_be_visible()  # the accordion opened
    expect(box).to_have_value(re.compile('"age": {"type": "integer"}'))
    expect(page.locator("#constraint-type input[value='JSON schema']")).to_be_checked()
    page.locator("#examples").get_by_text("Why is the sky blue?").click()  # the others clear it
    expect(page.locator("#constraint-type input[value='none']")).to_be_checked()
    expect(box).to_have_value("")
    assert page.errors == []
