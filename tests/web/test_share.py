"""Shareable runs (web/share.py, web/share_view.py) and the speculation curve (web/spec_curve.py).

Pure: a run's document survives JSON and the Redis form value for value, bad files are refused with a reason, the
curve is Leviathan's. In a real headless Chromium against a real tiny-model replica: Share gives a link that opens
the same run, token for token, on another playground after the replica restarted; the downloaded file uploads back
to the same run; malformed and oversized files give a message; Re-run live runs the saved settings again.
"""
from __future__ import annotations

import copy
import json
import math
import re
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from playwright.sync_api import expect

from shared.keys import Keys
from shared.protocol import (
    BeamEvent,
    Completion,
    DoneEvent,
    DraftCheck,
    GenerationRequest,
    Metrics,
    SamplerStage,
    SamplingOptions,
    TokenEvent,
    TokenLogprob,
)
from tests.replicas import Replica
from tests.web.conftest import TINY_KV_BLOCKS, WebApp
from tests.web.test_browser import MODES, open_playground, set_number, wait_columns_final
from tests.web.test_browser import pytestmark as needs_chromium
from web import share
from web.columns import Token
from web.modes import Settings, build_request
from web.session import Run, Service
from web.spec_curve import expected_tokens, spec_curve_html


# ---- the speed-up curve
@pytest.mark.parametrize("alpha, k", [(0.0, 4), (0.3, 1), (0.6, 3), (0.875, 4), (0.99, 8)])
def test_expected_tokens_per_step_is_the_accepted_prefix_plus_the_target_s_token(alpha, k):
    # E = sum_{i=0..k} alpha^i: draft i is kept only if the i drafts before it were, the target adds one
    assert expected_tokens(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))
    assert expected_tokens(1.0, k) == k + 1


def test_the_curve_marks_the_run_s_acceptance_on_its_k_and_what_it_measured():
    html = spec_curve_html(0.8, 4, measured=3.1)
    box = re.search(r'<div class="spec-curve" ([^>]*)>', html).group(1)
    assert 'data-alpha="0.8000"' in box and f'data-expected="{expected_tokens(0.8, 4):.4f}"' in box
    assert 'data-measured="3.1000"' in box
    bold = re.search(r'<polyline class="sc-c" data-k="4" points="([^"]*)"', html).group(1).split()
    dot = re.search(r'<circle class="sc-dot" cx="([\d.]+)" cy="([\d.]+)"', html).groups()
    assert f"{dot[0]},{dot[1]}" == bold[20]  # alpha 0.8 is the 21st of the 26 points: the dot sits on the curve
    assert html.count('class="sc-o"') == 3  # k = 1, 2, 8 beside it, for scale
    assert spec_curve_html(None, 4) == ""


# ---- the document
def _run() -> Run:
    """A run whose greedy, beam and speculative columns hold what the engine streams (no engine)."""
    run = Run(Service("redis://127.0.0.1:1/0", Keys("t")), Settings(prompt="Hi", spec_k=2, max_tokens=3.0))
    for mode, col in run.columns.items():
        col.request = GenerationRequest(prompt="Hi", params=SamplingOptions(max_tokens=3, logprobs=2, mode=mode))
        lps = [TokenLogprob(token_id=5 + i, token=f"t{i}", logprob=-0.1 * (i + 1) / 3, entropy=0.7,
                            top=[(5 + i, f"t{i}", -0.1 * (i + 1) / 3), (9, "x", -2.5)]) for i in range(3)]
        spec = ["target", "accepted", "bonus"] if mode == "speculative" else None
        drafts = [None, DraftCheck(position=0, draft_token_id=6, draft_token="t1", p_draft=0.5, p_target=0.9,
                                   accept_prob=1.0, accepted=True), None] if spec else None
        beam = [BeamEvent(kind="fork", step=0, node=1, parent=0, token_id=5, token="t0", logprob=-0.1, score=-0.1,
                          rank=0, blocks=[3])] if mode == "beam" else None
        stages = [[SamplerStage(name=name, top=[(5 + i, f"t{i}", 0.6), (9, "x", 0.1)], kept=kept, removed=0.3,
                                other=0.3, chosen_rank=0, chosen_prob=0.6)
                   for name, kept in (("raw", 49), ("top_k", 2))]
                  for i in range(3)] if mode == "sample" else None  # the sampler pipeline, as streamed
        col.feed(TokenEvent(request_id=col.request_id, seq=0, text_delta="t0t1t2", token_ids=[5, 6, 7],
                            logprobs=lps, spec=spec, drafts=drafts, beam=beam, stages=stages))
        col.feed(DoneEvent(request_id=col.request_id, seq=1, finish_reason="length", text="t0t1t2",
                           outputs=[Completion(index=0, text="t0t1t2", token_ids=[5, 6, 7], finish_reason="length",
                                               cumulative_logprob=-0.2, logprobs=lps, spec=spec, drafts=drafts)],
                           metrics=Metrics(replica="r1", completion_tokens=3, ttft_s=0.01, tpot_s=1 / 3)))
    run.fork("greedy", 0, 1, Token("y", 9, -2.5))  # a branch, its request not sent: it is saved as it stands
    run.trees["greedy"].branches[1].column.status = "cancelled"
    return run


def _same(a: share.SavedRun, b: share.SavedRun) -> bool:
    return a.model_dump(exclude={"saved_at"}) == b.model_dump(exclude={"saved_at"})


def test_a_saved_run_comes_back_equal_from_its_file_and_its_redis_value():
    doc = share.saved_run(_run())
    assert type(doc.settings.max_tokens) is int  # as the slider meant it (it gave 3.0)
    for back in (share.loads(share.dumps(doc)), share.unpack(share.pack(doc))):
        assert back == doc
        again = Run(Service("redis://127.0.0.1:1/0", Keys("t")), back.settings)
        share.restore(back, again)
        assert _same(share.saved_run(again), doc)  # restored into a Run, it saves as the same document
        lp = again.columns["speculative"].outputs[0].tokens[1]
        assert lp.logprob == -0.2 / 3 and lp.draft.accepted and lp.top[1] == (9, "x", -2.5)
        assert again.trees["greedy"].current.label == "@1 ‘y’" and len(again.columns["beam"].beam_tree) == 1
        assert again.columns["sample"].outputs[0].tokens[2].stages[1].kept == 2  # the pipeline travels too


def test_a_run_saved_before_adaptive_k_reruns_with_k_drafts_a_step():
    doc = json.loads(share.dumps(share.saved_run(_run())))
    assert doc["settings"]["spec_adaptive"] is True  # the control's default, saved
    del doc["settings"]["spec_adaptive"]  # as files saved before the control were
    back = share.loads(json.dumps(doc))
    assert back.settings.spec_adaptive is False
    assert build_request("speculative", back.settings).params.speculative_schedule == "constant"


@pytest.mark.parametrize("text, why", [
    ("{not json", "not JSON"),
    ('{"kind": "something-else"}', "not a DecodeLab run"),
    ('{"kind": "decodelab-run", "v": 99}', "version 99"),
    ('{"kind": "decodelab-run", "v": 1, "saved_at": "yesterday"}', "saved_at"),
    ("x" * (share.MAX_FILE_BYTES + 1), "over the 8 MiB"),
])
def test_a_file_that_is_not_a_run_of_this_version_is_refused_with_why(text, why):
    with pytest.raises(share.ShareError, match=why):
        share.loads(text)


def test_a_document_missing_a_column_or_a_stored_value_that_is_damaged_is_refused():
    doc = share.saved_run(_run())
    del doc.trees["beam"]
    with pytest.raises(share.ShareError, match="trees: one per mode"):
        share.restore(doc, Run(Service("redis://127.0.0.1:1/0", Keys("t")), doc.settings))
    with pytest.raises(share.ShareError, match="damaged"):
        share.unpack("not base64!")


def _open(text: str) -> None:
    """What opening a run file does: load it, restore it into a Run, draw it, save it again."""
    from web.handlers import Handlers

    service = Service("redis://127.0.0.1:1/0", Keys("t"))
    back = share.loads(text)
    run = Run(service, back.settings, back.share_prompt, client_id="")
    share.restore(back, run)
    Handlers(service)._frame(run, {}, final=True)
    share.saved_run(run)


def test_a_run_file_whose_log_probs_are_impossible_still_opens():
    """Found by editing run files (session 37): a token's log-prob of 1e9 raised OverflowError out of the drawing
    (math.exp), failing the upload with no message; a probability is now drawn from min(log-prob, 0)."""
    doc = json.loads(share.dumps(share.saved_run(_run())))

    def bump(node):
        if isinstance(node, dict):
            for k, v in node.items():
                node[k] = 1e9 if k == "logprob" and v is not None else bump(v)
        elif isinstance(node, list):
            return [bump(x) for x in node]
        return node

    _open(json.dumps(bump(doc)))


def _paths(node, path=()):
    yield path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*path, k))


ODD = [None, 0, -1, 2, 10 ** 9, -10 ** 9, 1.5, "", "x", [], {}, [0], True, "beam"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, len(ODD) + 1)), min_size=1, max_size=3))
def test_any_edit_of_a_run_file_is_refused_with_why_or_shown(edits):
    """A run file is the user's to edit (or damage): whatever it holds, opening it is a ShareError that says why,
    or the run shown (restored, drawn, saved again); what the edits found is the test above."""
    doc = json.loads(share.dumps(share.saved_run(_run())))
    for at, what in edits:
        paths = [p for p in _paths(doc) if p]
        path = paths[at % len(paths)]
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if what == len(ODD):  # drop it
            del parent[path[-1]]
        # copies: a container of ODD's put in the document, then an edit inside it, changed ODD for the examples
        # after it, or put a list in itself (hypothesis found both: a cycle json.dumps refuses)
        elif what == len(ODD) + 1 and isinstance(parent, list):  # repeat it
            parent.append(copy.deepcopy(parent[path[-1]]))
        else:
            parent[path[-1]] = copy.deepcopy(ODD[what % len(ODD)])
    try:
        _open(json.dumps(doc))
    except share.ShareError:
        pass


def test_a_beam_node_of_a_kind_the_page_does_not_draw_is_refused():
    # hypothesis found it: a node's kind emptied, the file opened and drawing the tree raised KeyError
    doc = json.loads(share.dumps(share.saved_run(_run())))
    nodes = [n for t in doc["trees"].values() for b in t["branches"] for n in b["column"]["beam_nodes"]]
    assert nodes
    nodes[0]["kind"] = ""
    with pytest.raises(share.ShareError, match="kind"):
        _open(json.dumps(doc))


def test_a_branch_without_the_tokens_it_forked_from_is_refused():
    # hypothesis found it in CI: a child branch's inherited tokens emptied, the file opened and drawing the branch
    # list raised IndexError (its label names the picked token, the last inherited one)
    doc = json.loads(share.dumps(share.saved_run(_run())))
    children = [b for t in doc["trees"].values() for b in t["branches"] if b["parent"] is not None]
    assert children
    children[0]["inherited"] = []
    with pytest.raises(share.ShareError, match="inherits"):
        _open(json.dumps(doc))


@pytest.mark.parametrize("edit, why", [
    (lambda nodes: nodes[1].update(parent=-1), "parent -1 is not a node"),  # hypothesis found it in CI (KeyError)
    (lambda nodes: nodes[0].update(parent=nodes[1]["id"]), "no root"),
    (lambda nodes: nodes[1].update(step=nodes[0]["step"]), "not a node of an earlier step"),  # (rules out loops)
    (lambda nodes: nodes[1].update(children=[10 ** 6]), "child that is not a node"),
])
def test_a_beam_tree_the_page_cannot_draw_is_refused(edit, why):
    doc = json.loads(share.dumps(share.saved_run(_run())))
    nodes = doc["trees"]["beam"]["branches"][0]["column"]["beam_nodes"]
    assert len(nodes) >= 2 and nodes[0]["id"] == 0
    edit(nodes)
    with pytest.raises(share.ShareError, match=why):
        _open(json.dumps(doc))


def test_a_column_with_a_first_token_time_and_no_last_or_done_still_opens():
    # hypothesis found it in CI (session 43): a column's done event and last token time emptied, the file opened and
    # its TPOT raised TypeError (None - float); a column without both times has no TPOT to show
    doc = json.loads(share.dumps(share.saved_run(_run())))
    columns = [b["column"] for t in doc["trees"].values() for b in t["branches"]]
    for col in columns:
        col["done"], col["last_token_at"], col["first_token_at"] = None, None, 1.0
    _open(json.dumps(doc))


# ---- in a real browser, against a real replica that restarts
@pytest.fixture(scope="module")
def share_stack(redis_server, tiny_llama_dir):
    """(Redis URL, keys, the replicas so far, web app, a function that starts the replica again) on their own key
    prefix: this module restarts the replica."""
    keys = Keys(f"web-share-{uuid.uuid4().hex[:6]}")
    args = ("--num-kv-blocks", str(TINY_KV_BLOCKS), "--max-num-seqs", "16")
    replicas = [Replica(tiny_llama_dir, redis_server.url, keys, "share-1", *args)]
    web = WebApp(redis_server.url, keys)
    try:
        replicas[0].wait_ready()
        again = lambda: Replica(tiny_llama_dir, redis_server.url, keys, "share-1", *args)  # noqa: E731
        yield redis_server.url, keys, replicas, web, again
    finally:
        web.close()
        replicas[-1].stop()


SHOWN_JS = """(modes) => Object.fromEntries(modes.map(m => {
    const col = document.querySelector('#out-' + m + ' .dl-col');
    const txt = col.querySelector(':scope > .txt').cloneNode(true);
    txt.querySelectorAll('.tip').forEach(t => t.remove());
    return [m, {text: txt.innerHTML, metrics: col.querySelector('.mts').textContent,
                beams: [...col.querySelectorAll('.beam')].map(b => b.textContent)}]; }))"""


def shown(page) -> dict:
    """Each column's tokens as drawn (their data-lp, data-alts, data-h, data-d, marks), metrics and beams."""
    return page.evaluate(SHOWN_JS, list(MODES))


def stamps(page) -> dict[str, int]:
    """Each column's drawing stamp (web/render.py drawing_stamp: later drawings, larger stamps)."""
    return {m: int(page.locator(f"#out-{m} .dl-col").get_attribute("data-seq")) for m in MODES}


def trace(page) -> dict[str, str]:
    return {m: page.locator(f'#trace polyline.tr-p[data-mode="{m}"]').get_attribute("data-p") for m in MODES}


def _upload(page, path) -> None:
    with page.expect_file_chooser() as chooser:
        page.locator("#upload-run").click()
    chooser.value.set_files(str(path))


def _download(page, tmp_path, name: str):
    # Share's one answer enables the button with the link; once, in a full run on the loaded box, the button was
    # still disabled 15 s after the link showed (not seen alone in 5 runs of this module): a longer wait
    expect(page.locator("#download-run")).to_be_enabled(timeout=45_000)
    with page.expect_download() as d:
        page.locator("#download-run").click()
    path = tmp_path / name
    d.value.save_as(path)
    return path


@needs_chromium
def test_a_shared_run_reopens_token_for_token_after_a_restart_and_as_a_file(share_stack, browser, page, tmp_path):
    redis_url, keys, replicas, web, start_replica = share_stack
    open_playground(page, web.url, "Sharing check: the quick brown fox")
    set_number(page, "max-tokens", 10)
    page.locator("#run").click()
    assert wait_columns_final(page, 60_000) == dict.fromkeys(MODES, "done")
    before, before_trace = shown(page), trace(page)
    assert all(before[m]["text"].count('class="tk') >= 1 for m in MODES)

    replicas[0].kill()  # the replica that ran it dies and starts again (loading while the run is shared)
    replicas.append(start_replica())
    page.locator("#share-run").click()
    link = page.locator("#dl-share a[data-run]")
    expect(link).to_have_attribute("href", re.compile(r"^http://127\.0\.0\.1:\d+/\?run=[\w-]{16}$"))
    run_id = link.get_attribute("data-run")
    saved = json.loads(_download(page, tmp_path, "saved.json").read_text())
    assert saved["kind"] == "decodelab-run" and saved["v"] == 1

    other = WebApp(redis_url, keys)  # a second playground of the deployment opens the link, once the replica is back
    try:
        replicas[-1].wait_ready()
        fresh = browser.new_page()
        fresh.goto(f"{other.url}?run=NoSuchRun0000000")  # expired, or never saved: a message, the page as it was
        expect(fresh.locator("#dl-message .dl-msg.error")).to_contain_text("no saved run NoSuchRun0000000")
        fresh.goto(f"{other.url}?run={run_id}")
        expect(fresh.locator("#rerun")).to_be_visible(timeout=15_000)
        assert wait_columns_final(fresh, 10_000) == dict.fromkeys(MODES, "done")
        assert shown(fresh) == before and trace(fresh) == before_trace
        fresh.locator("#out-greedy .dl-col > .txt .tk").nth(2).click()  # branching sends requests: not here
        fresh.locator("#dl-pop .alt").nth(1).click()
        expect(fresh.locator("#dl-message .dl-msg.error")).to_contain_text("read-only", timeout=5_000)
        fresh.locator("#share-run").click()  # saved again from the re-opened run: the same numbers, exactly
        expect(fresh.locator("#download-run")).to_be_enabled()
        again = json.loads(_download(fresh, tmp_path, "again.json").read_text())
        assert {k: v for k, v in again.items() if k != "saved_at"} == {k: v for k, v in saved.items()
                                                                        if k != "saved_at"}
        fresh.close()
    finally:
        other.close()

    page.goto(web.url)  # a fresh session: the file brings the run back
    expect(page.locator("#dl-service")).to_contain_text("1 replica", timeout=10_000)
    _upload(page, tmp_path / "saved.json")
    expect(page.locator("#rerun")).to_be_visible(timeout=10_000)
    assert shown(page) == before and trace(page) == before_trace
    expect(page.locator("#dl-share")).to_contain_text("opened from a file")

    (tmp_path / "bad.json").write_text('{"kind": "decodelab-run", "v": 1, "trees": 3}')
    _upload(page, tmp_path / "bad.json")
    expect(page.locator("#dl-message .dl-msg.error")).to_contain_text("run file:", timeout=5_000)
    (tmp_path / "big.json").write_bytes(b" " * (share.MAX_FILE_BYTES + 1))
    _upload(page, tmp_path / "big.json")
    expect(page.locator("#dl-message .dl-msg.error")).to_contain_text("over the 8 MiB limit", timeout=5_000)
    assert shown(page) == before  # the run shown stays

    drawn = stamps(page)
    page.locator("#rerun").click()  # live again, with the saved settings, on the new replica
    expect(page.locator("#rerun")).to_be_hidden()
    expect(page.locator("#prompt textarea")).to_have_value("Sharing check: the quick brown fox")
    # every column drawn anew (a later stamp than the saved run's drawing) and ended
    page.wait_for_function("""([modes, drawn]) => modes.every(m => {
        const el = document.querySelector('#out-' + m + ' .dl-col');
        return Number(el.dataset.seq) > drawn[m] && ['done', 'error', 'cancelled', 'invalid'].includes(
            el.dataset.status); })""", arg=[list(MODES), drawn], timeout=60_000)
    assert {m: page.locator(f"#out-{m} .dl-col").get_attribute("data-status") for m in MODES} == dict.fromkeys(
        MODES, "done")
    live = shown(page)
    greedy_ids = [int(i) for i in re.findall(r'data-id="(\d+)"', live["greedy"]["text"])]
    assert greedy_ids == [int(i) for i in re.findall(r'data-id="(\d+)"', before["greedy"]["text"])]
    assert not any(math.isnan(float(p)) for p in trace(page)["greedy"].split(","))
    assert page.errors == []


def test_a_rerun_fills_every_control_of_the_page():
    from web.share_view import CONTROLS, settings_values
    assert len(settings_values(Settings(prompt="x", pipeline=True), True, {})) == CONTROLS
    values = settings_values(Settings(prompt="x", pipeline=True, spec_adaptive=False), True, {})
    assert values[-2:] == [True, False]  # the pipeline box and adaptive k too
