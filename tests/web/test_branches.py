"""The branch tree of a column (web/branches.py) and its HTML: pure data, no Redis, no browser."""
from __future__ import annotations

import json
import re

import pytest

from shared.protocol import Completion, DoneEvent, TokenEvent, TokenLogprob
from web.branches import MAX_BRANCHES, BranchError, BranchTree, continuation
from web.columns import Column, Token
from web.render import column_html


def _column(mode: str, words: list[str], first_id: int = 10) -> Column:
    col = Column(mode)
    lps = [TokenLogprob(token_id=first_id + i, token=w, logprob=-0.5, top=[(first_id + i, w, -0.5), (99, " x", -1.5)],
                        entropy=1.0 + i) for i, w in enumerate(words)]
    col.feed(TokenEvent(request_id="r", seq=0, text_delta="".join(words), token_ids=[lp.token_id for lp in lps],
                        logprobs=lps))
    return col


def test_a_fork_inherits_the_parents_tokens_up_to_the_fork_and_the_picked_token():
    tree = BranchTree.of(_column("greedy", ["The", " sky", " is", " blue"]))
    branch = tree.fork(0, 2, Token(" was", 77), Column("greedy"))
    assert [t.text for t in branch.tokens()] == ["The", " sky", " was"]
    assert branch.label == "@2 ‘ was’" and branch.parent == 0 and branch.depth == 1
    assert tree.active == branch.id == 1
    assert continuation(branch.inherited).parts == [[10, 11, 77]]


def test_typed_text_travels_as_text_between_token_ids():
    tree = BranchTree.of(_column("greedy", ["a", "b", "c"]))
    typed = tree.fork(0, 1, Token(" hello"), Column("greedy"))
    typed.column.feed(TokenEvent(request_id="r2", seq=0, text_delta="z", token_ids=[5]))
    child = tree.fork(typed.id, 3, Token("q", 42), Column("greedy"))
    assert continuation(child.inherited).parts == [[10], " hello", [5, 42]]


def test_switching_is_instant_and_keeps_every_branchs_tokens():
    root = _column("sample", ["x", "y"])
    tree = BranchTree.of(root)
    tree.fork(0, 0, Token("w", 3), Column("sample"))
    v = tree.version
    assert tree.switch(0) is tree.root and tree.version != v
    assert [t.text for t in tree.current.tokens()] == ["x", "y"]
    assert [t.text for t in tree.switch(1).tokens()] == ["w"]


def test_the_tree_is_drawn_depth_first():
    tree = BranchTree.of(_column("greedy", ["a", "b", "c"]))
    tree.fork(0, 1, Token("B", 1), Column("greedy"))
    tree.fork(0, 2, Token("C", 2), Column("greedy"))
    tree.fork(1, 1, Token("D", 4), Column("greedy"))
    assert [b.id for b in tree.ordered()] == [0, 1, 3, 2]


@pytest.mark.parametrize("pos, picked, why", [(9, Token("x", 1), "position"), (0, Token(""), "token")])
def test_impossible_forks_are_refused(pos, picked, why):
    tree = BranchTree.of(_column("greedy", ["a"]))
    with pytest.raises(BranchError, match=why):
        tree.fork(0, pos, picked, Column("greedy"))
    with pytest.raises(BranchError, match="branch"):
        tree.switch(5)


def test_a_column_has_at_most_max_branches():
    tree = BranchTree.of(_column("greedy", ["a"]))
    for _ in range(MAX_BRANCHES - 1):
        tree.fork(0, 0, Token("b", 1), Column("greedy"))
    with pytest.raises(BranchError, match="at most"):
        tree.fork(0, 0, Token("b", 1), Column("greedy"))


def test_html_carries_positions_alternatives_both_shadings_and_the_tree():
    tree = BranchTree.of(_column("greedy", ["The", " sky"]))
    html = column_html(tree.root.column, tree=tree)
    assert 'data-branch="0"' in html and 'class="dl-tree"' not in html  # one branch: no tree
    assert re.search(r'style="--u:0\.39;--h:0\.20" data-pos="0"', html)
    alts = json.loads(re.search(r'data-pos="1" data-alts="([^"]*)"', html).group(1).replace("&quot;", '"'))
    assert alts[0][:2] == [11, " sky"] and alts[1][0] == 99
    assert 'data-h="2.00"' in html  # the entropy, for the hover card (web/tips.js)
    tree.fork(0, 1, Token(" sea", 50, -2.0), Column("greedy"))
    html = column_html(tree.root.column, tree=tree)
    assert html.count('class="tb') == 2 and 'data-branch="1"' in html
    assert 'class="tk inh"' in html and 'class="tk fork"' in html


def test_a_branch_that_ends_while_its_caller_draws_still_gets_its_final_frame():
    """Run.follow's last yield shows the ended column, however long the caller took over the frame before.
    (It used to return on `finished` without drawing the change: the page kept "queued" for a branch that had
    streamed and finished while the handler read the KV panel.)"""
    import asyncio

    from web.modes import Settings
    from web.session import Run, Service

    run = Run(Service("redis://127.0.0.1:1"), Settings(prompt="x"))
    branch = run.trees["greedy"].fork(0, 0, Token(" y", 5), Column("greedy"))

    async def stream(col: Column) -> None:  # the replica's events, arriving while the caller is busy
        await asyncio.sleep(0.05)
        col.feed(TokenEvent(request_id="r", seq=0, text_delta=" z", token_ids=[6]))
        col.feed(DoneEvent(request_id="r", seq=1, finish_reason="length", text=" z",
                           outputs=[Completion(index=0, text=" z", token_ids=[6], finish_reason="length")]))

    async def main() -> list[str]:
        run._stream = stream
        seen = []
        async for _ in run.follow(branch, min_interval=0.01):
            seen.append(branch.column.status)
            await asyncio.sleep(0.2)  # a slow frame: the stream ends meanwhile
        return seen

    seen = asyncio.run(main())
    assert seen[-1] == "done", seen


def test_every_drawing_of_a_column_is_stamped_later_than_the_one_before():
    col = _column("greedy", [" a", " b"])
    stamps = [int(re.search(r'data-seq="(\d+)"', column_html(col)).group(1)) for _ in range(1000)]
    assert all(b > a for a, b in zip(stamps, stamps[1:]))
    assert stamps[-1] < 2 ** 53  # exact as a JavaScript number


def test_the_runs_last_frame_sends_an_unchanged_column_as_drawn_before():
    """The last frame (what the API returns) has every column; one unchanged since its last drawing goes as the
    same string, old stamp and all: the page neither redraws it (an open hover card stays) nor lets it land over a
    branch drawn since (web/draw.js)."""
    import gradio as gr

    from web.handlers import Handlers
    from web.modes import MODES, Settings
    from web.session import Run, Service

    service = Service("redis://127.0.0.1:1")
    handlers, run = Handlers(service), Run(service, Settings(prompt="x"))
    run.columns["greedy"].feed(TokenEvent(request_id="r", seq=0, text_delta=" a", token_ids=[5]))
    seen: dict = {}
    first = handlers._frame(run, seen)[1:1 + len(MODES)]
    assert handlers._frame(run, seen)[1:1 + len(MODES)] == (gr.skip(),) * len(MODES)
    assert handlers._frame(run, seen, final=True)[1:1 + len(MODES)] == first
    run.columns["greedy"].feed(TokenEvent(request_id="r", seq=1, text_delta=" b", token_ids=[6]))
    last = handlers._frame(run, seen, final=True)[1:1 + len(MODES)]
    changed = {m for m, a, b in zip(MODES, first, last) if a != b}
    assert changed == {"greedy", "speculative"}  # speculative is drawn against greedy's tokens


def test_a_handed_over_column_names_both_replicas_and_the_transfer():
    """Prefill/decode disaggregation: the pill says where the prompt was computed and where it was decoded."""
    from shared.protocol import DoneEvent, Metrics

    col = _column("greedy", ["a"])
    col.status = "done"
    col.done = DoneEvent(request_id="r", seq=1, attempt=1, finish_reason="length", text="a", outputs=[],
                         metrics=Metrics(replica="decode-1", handover={"from": "prefill-1", "blocks": 3,
                                                                       "bytes": 1_500_000, "transfer_ms": 7.5,
                                                                       "imported_tokens": 48}))
    html = column_html(col)
    assert "done · prefill-1 → decode-1" in html
    assert "3 KV blocks (1.50 MB) handed over in 8 ms" in html and "48 prompt tokens" in html
