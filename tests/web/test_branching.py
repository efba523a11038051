"""Branch from any token and the entropy shading, in a real headless Chromium against a real replica."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

from playwright.sync_api import expect

from tests.web.test_browser import pytestmark, set_number, wait_columns_final  # noqa: F401 (pytestmark: skip)

PROMPT = ("Readability counts. Special cases aren't special enough to break the rules. Although practicality beats "
          "purity. Errors should never pass silently. The capital of France is")
TOKENS_JS = """(sel) => [...document.querySelectorAll(sel)].map(s => {
    const c = s.cloneNode(true); c.querySelectorAll('.tip').forEach(t => t.remove()); return c.textContent; })"""
MAIN = "#out-greedy .dl-col > .txt .tk"


def texts(page) -> list[str]:
    return page.evaluate(TOKENS_JS, MAIN)


def run_raw_prompt(page, url: str, max_tokens: int) -> None:
    """The page at `url`, PROMPT without the chat template, `max_tokens`, Run."""
    page.goto(url)
    expect(page.locator("#dl-service")).to_contain_text("1 replica", timeout=10_000)
    page.locator("#prompt textarea").fill(PROMPT)
    page.locator("#chat input[type=checkbox]").uncheck()
    set_number(page, "max-tokens", max_tokens)
    page.locator("#run").click()


def test_branch_from_a_token_streams_a_branch_and_switching_back_is_instant(tiny_stack, page):
    web, _, _ = tiny_stack
    run_raw_prompt(page, web.url, 10)
    assert wait_columns_final(page, 60_000)["greedy"] == "done"
    root = texts(page)
    assert len(root) == 10

    page.locator(f'{MAIN}[data-pos="3"]').click()  # the alternatives, with their probabilities
    pop = page.locator("#dl-pop")
    expect(pop).to_be_visible()
    alts = pop.locator(".alt")
    expect(alts).to_have_count(5)
    expect(alts.nth(1).locator("span")).to_have_text(re.compile(r"\d+\.\d%"))
    picked = alts.nth(1).locator("code").inner_text().replace("↵", "\n").replace("⇥", "\t")
    alts.nth(1).click()

    col = page.locator("#out-greedy .dl-col")
    expect(col).to_have_attribute("data-branch", "1", timeout=5_000)
    expect(page.locator("#out-greedy .dl-tree .tb")).to_have_count(2)
    expect(col).to_have_attribute("data-status", "done", timeout=30_000)
    branch = texts(page)
    assert branch[:3] == root[:3] and branch[3] == (picked if picked != "∅" else "")
    assert len(branch) > 4  # it generated after the fork
    assert page.locator("#out-greedy .tk.fork").count() == 1
    title = page.locator('#out-greedy .dl-tree .tb[data-branch="1"]').get_attribute("title")
    assert int(re.search(r"(\d+) prompt tokens from the prefix cache", title).group(1)) > 0  # the parent's blocks
    expect(page.locator("#kv")).to_contain_text("greedy")
    page.locator(f'{MAIN}[data-pos="5"]').click()  # the popup over a branch, for the picture
    page.locator("#out-greedy").screenshot(path=str(Path(tempfile.gettempdir()) / "decodelab-branching.png"))
    page.keyboard.press("Escape")
    expect(page.locator("#dl-pop")).to_have_count(0)

    page.locator('#out-greedy .dl-tree .tb[data-branch="0"]').click()
    expect(col).to_have_attribute("data-branch", "0", timeout=2_000)
    assert texts(page) == root
    assert page.errors == []


def test_the_entropy_toggle_switches_the_shading(tiny_stack, page):
    web, _, _ = tiny_stack
    run_raw_prompt(page, web.url, 6)
    wait_columns_final(page, 60_000)
    token = page.locator(f'{MAIN}[data-pos="2"]')
    assert re.search(r"--h:\d\.\d\d", token.get_attribute("style"))  # the replica sent its entropy
    background = lambda: token.evaluate("t => getComputedStyle(t).backgroundColor")  # noqa: E731
    before = background()
    page.locator("#shade").get_by_text("entropy", exact=True).click()
    expect(page.locator("html")).to_have_attribute("data-shade", "entropy")
    assert background() != before
    page.locator("#shade").get_by_text("probability", exact=True).click()
    expect(page.locator("html")).to_have_attribute("data-shade", "probability")
    assert background() == before
    assert page.errors == []


def test_branching_while_the_run_streams_breaks_neither(tiny_stack, page):
    web, _, _ = tiny_stack
    run_raw_prompt(page, web.url, 150)
    first = page.locator(f'{MAIN}[data-pos="1"]')
    expect(first).to_be_visible(timeout=30_000)
    first.click()
    page.locator("#dl-pop .typed input").fill(" typed")  # typed text instead of an alternative
    page.locator("#dl-pop .typed button").click()
    col = page.locator("#out-greedy .dl-col")
    expect(col).to_have_attribute("data-branch", "1", timeout=5_000)
    expect(page.locator("#out-greedy .tk.fork")).to_have_text(re.compile("^ typed"))
    status = wait_columns_final(page, 120_000)
    assert set(status.values()) == {"done"}, status  # the root runs of all four columns ended normally
    expect(col).to_have_attribute("data-status", "done", timeout=60_000)
    page.locator('#out-greedy .dl-tree .tb[data-branch="0"]').click()
    expect(col).to_have_attribute("data-branch", "0", timeout=2_000)
    assert len(texts(page)) == 150
    assert page.errors == []


NEWER_THEN_OLDER_JS = """() => {
    // the column's own drawing function (web/draw.js), fed as Gradio feeds it: a frame stamped later, then one
    // stamped before it that arrives after it
    const host = document.querySelector('#out-greedy');
    const el = [...host.querySelectorAll('*')].find((e) => e.dlDraw);
    const html = el.dlDrawn(), seq = Number(el.querySelector('.dl-col').dataset.seq);
    const frame = (stamp, status, probe) => html.replace(/data-seq="\\d+"/, `data-seq="${stamp}"`)
        .replace(/data-status="\\w+"/, `data-status="${status}"`)
        .replace('<div class="txt">', `<div class="txt"><b class="probe">${probe}</b>`);
    el.dlDraw(frame(seq + 10, 'done', 'newer'));
    el.dlDraw(frame(seq + 5, 'running', 'older'));
    const col = el.querySelector('.dl-col');
    return [col.dataset.seq === String(seq + 10), col.dataset.status, col.querySelector('.probe').textContent];
}"""


def test_a_column_keeps_its_newest_drawing_when_frames_cross(tiny_stack, page):
    """web/draw.js: Run and a branch's stream both draw a column, and Gradio sends a stream's last frame again
    when it completes, so an older frame can land after a newer one; the page keeps the newer one."""
    web, _, _ = tiny_stack
    run_raw_prompt(page, web.url, 6)
    wait_columns_final(page, 60_000)
    col = page.locator("#out-greedy .dl-col")
    seqs = [col.get_attribute("data-seq"), None]
    while seqs[-1] != seqs[-2]:  # the run's last frames (the same drawing, stamped later) are in
        page.wait_for_timeout(500)
        seqs.append(col.get_attribute("data-seq"))
    assert page.evaluate(NEWER_THEN_OLDER_JS) == [True, "done", "newer"]
    page.locator(f'{MAIN}[data-pos="2"]').click()  # a real frame after that (stamped later) is drawn as usual
    page.locator("#dl-pop .alt").nth(1).click()
    expect(col).to_have_attribute("data-branch", "1", timeout=5_000)
    expect(col).to_have_attribute("data-status", "done", timeout=30_000)
    assert len(texts(page)) > 3
    assert page.errors == []


GROWN_JS = """() => {
    // a frame whose token text grew by one token: web/draw.js appends it and keeps every node drawn before (a hover
    // card open on a token stays); a part that changed otherwise (the metrics) is replaced
    const el = [...document.querySelector('#out-greedy').querySelectorAll('*')].find((e) => e.dlDraw);
    const html = el.dlDrawn(), seq = Number(el.querySelector('.dl-col').dataset.seq);
    const first = el.querySelector('.dl-col > .txt .tk'), metrics = el.querySelector(".dl-col > .mts");
    first.insertAdjacentHTML('beforeend', '<span class="tip">card</span>');
    const grown = html.replace(/data-seq="\\d+"/, `data-seq="${seq + 1}"`)
        .replace(/(<div class="txt">[\\s\\S]*?)<\\/div>/, '$1<span class="tk" data-pos="99">grown</span></div>')
        .replace('<div class="mts">', '<div class="mts"><b class="probe">m</b>');
    el.dlDraw(grown);
    const tks = el.querySelectorAll('.dl-col > .txt .tk');
    return [el.querySelector('.dl-col > .txt .tk') === first, first.querySelector('.tip') !== null,
            tks[tks.length - 1].textContent, el.querySelector(".dl-col > .mts") !== metrics,
            el.querySelector(".dl-col > .mts .probe") !== null, el.querySelector('.dl-col').dataset.seq];
}"""


def test_a_grown_column_appends_its_new_tokens_and_keeps_the_drawn_ones(tiny_stack, page):
    web, _, _ = tiny_stack
    run_raw_prompt(page, web.url, 6)
    wait_columns_final(page, 60_000)
    page.wait_for_timeout(1_000)  # the run's last frames are in
    seq = int(page.locator("#out-greedy .dl-col").get_attribute("data-seq"))
    assert page.evaluate(GROWN_JS) == [True, True, "grown", True, True, str(seq + 1)]
    assert page.errors == []
