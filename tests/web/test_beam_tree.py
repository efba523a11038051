"""The live beam tree: a real engine's beam events through the protocol (events.py) into the web's BeamTree, the
SVG it draws, and the beam column in a real headless Chromium against a real replica; plus the grammar-mask
mass in the token card."""
from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from engine_service.engine.llm_engine import LLMEngine
from engine_service.engine.sampling_params import SamplingParams
from engine_service.server.events import beam_events
from tests.web.test_browser import open_playground, set_number, wait_columns_final
from tests.web.test_browser import pytestmark as needs_chromium
from web.beam_tree import BeamTree, beam_tree_html
from web.columns import Column
from web.render import column_html


@pytest.fixture(scope="module")
def tree_and_outputs(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=128, block_size=8)
    eos = engine.tokenizer.encode("e", add_special_tokens=False)
    engine.add_request("b", list(range(5, 25)), SamplingParams(mode="beam", beam_width=3, n=3, max_tokens=10,
                                                               ignore_eos=True, stop_token_ids=eos))
    tree, final = BeamTree(), None
    while engine.has_unfinished():
        for out in engine.step():
            tree.feed(beam_events(engine.tokenizer, out.beam_events) or [])
            final = out
    return tree, final, engine.tokenizer


def _path_tokens(tree: BeamTree, node) -> list[str]:
    out = []
    while node.parent is not None:
        out.append(node.token)
        node = tree.nodes[node.parent]
    return out[::-1]


def test_the_best_path_spells_the_best_hypothesis(tree_and_outputs):
    tree, final, tok = tree_and_outputs
    best = tree.best()
    assert best is not None and best.kind == "finish"
    assert _path_tokens(tree, best) == [tok.decode([t]) for t in final.outputs[0].token_ids]
    kept = [n for n in tree.nodes.values() if n.kind == "finish" and not n.pruned]
    assert len(kept) == 3  # W hypotheses kept, the rest pruned
    alive = tree.alive()
    assert all(n.id in alive for n in kept) and 0 in alive
    assert any(n.id not in alive for n in tree.nodes.values()), "some beams were pruned on the way"


def test_the_svg_marks_finished_pruned_and_the_best_path(tree_and_outputs):
    tree, _, _ = tree_and_outputs
    html = beam_tree_html(tree)
    alive = tree.alive()
    kept = [n for n in tree.nodes.values() if n.kind == "finish" and n.id in alive]
    assert html.count('class="bn finish') == len(kept)
    assert html.count("<g class=\"bn") == len(alive)  # an element per node still alive
    assert html.count("a3,3 0 1,0 6,0") == len(tree.nodes) - len(alive)  # the pruned ones: one path of dots
    bold = tree.path(tree.best())
    on = re.search(r'<path class="be on" d="([^"]*)"', html).group(1)
    assert on.count("M") == len(bold) - 1  # one edge into each bold node but the root
    assert re.search(r"\d+ live beams hold \d+ block-table entries in \d+ distinct KV blocks", html) or tree.steps < 2


def test_a_new_attempt_starts_a_new_tree(tree_and_outputs, tiny_llama_dir):
    from shared.protocol import BeamEvent, TokenEvent

    col = Column("beam")
    ev = BeamEvent(kind="fork", step=0, node=1, parent=0, token_id=5, token="a", logprob=-1.0, score=-1.0, rank=0)
    col.feed(TokenEvent(request_id="r", seq=0, attempt=1, text_delta="a", token_ids=[5], reset=True, beam=[ev]))
    assert len(col.beam_tree) == 1
    col.feed(TokenEvent(request_id="r", seq=0, attempt=2, text_delta="a", token_ids=[5], reset=True, beam=[ev]))
    assert len(col.beam_tree) == 1 and col.restarts == 1  # the second replica's tree alone, not both
    assert 'class="bt"' in column_html(col)


# ---- in the browser
@needs_chromium
def test_the_beam_column_draws_its_tree_and_a_grammar_shows_the_masked_mass(tiny_stack, page):
    web, _, _ = tiny_stack
    open_playground(page, web.url, "the tree of beams")
    set_number(page, "max-tokens", 8)
    page.locator("#run").click()
    status = wait_columns_final(page, 90_000)
    assert status["beam"] == "done", status
    svg = page.locator("#out-beam svg.bt")
    expect(svg).to_be_visible()
    assert svg.locator("g.bn").count() > 8  # the prompt and the best path's 8 tokens at least, alive
    assert svg.locator("g.bn.finish").count() >= 1
    assert svg.locator("path.be.on").get_attribute("d").count("M") >= 8  # the best path, an edge per token
    assert svg.locator("path.bd").count() <= 1  # the pruned nodes, if any, as one path
    expect(page.locator("#out-beam .sect").filter(has_text="Beam tree")).to_contain_text("finished")
    title = svg.locator("g.bn.fork title").first.text_content()
    assert "logprob" in title and "KV blocks" in title

    # a regex constraint: each token's card says how much probability the grammar took away
    page.locator("#constraint").get_by_text("Constraint (structured output", exact=False).first.click()
    page.locator("#constraint-type").get_by_text("regex", exact=True).click()
    page.locator("#constraint-text textarea").fill("(ab|cd)+")
    page.locator("#run").click()
    masked = page.locator("#out-greedy .dl-col > .txt .tk[data-k]")
    expect(masked.first).to_be_attached(timeout=90_000)  # this run's tokens (the last run's had no grammar)
    wait_columns_final(page, 90_000)
    assert masked.count() >= 2
    masked.first.hover()  # the card is drawn on hover (web/tips.js)
    card = masked.first.locator(".tip .msk")
    expect(card).to_be_visible()
    assert re.fullmatch(r"grammar removed \d+\.\d% of the probability", card.text_content())
    page.locator("#shade").get_by_text("grammar mask", exact=True).click()
    expect(page.locator("html")).to_have_attribute("data-shade", "grammar mask")
    style = page.locator("#out-greedy .dl-col > .txt .tk").first.get_attribute("style") or ""
    assert "--k:" in style
    assert page.errors == []
