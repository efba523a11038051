"""The playground's share controls: save the last run for a link (`?run=<id>`), download it as a JSON file, open a
link or an uploaded file read-only, and re-run a saved run live with its settings.

A re-opened run becomes the session's run (Handlers.runs) marked `shared`, so the same renderers draw it, its
branches switch, and Share saves it again; nothing of it is sent to an engine until Re-run live.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from html import escape
from pathlib import Path

import gradio as gr
from redis.exceptions import RedisError

from web import share
from web.handlers import Handlers, session_of
from web.modes import Settings
from web.render import message_html
from web.session import Run

FILES_DIR = Path(tempfile.gettempdir()) / "decodelab-runs"  # downloads, for Gradio to serve
KEEP_FILES = 200  # the newest downloads kept on disk
REDIS_WAIT_S = 3.0
# the link as the visitor's address bar would show it (the server sees only its own routes)
LINK_JS = """() => { const a = document.querySelector('#dl-share a[data-run]');
  if (a) { a.href = location.origin + location.pathname + '?run=' + a.dataset.run; a.textContent = a.href; } }"""


def link_html(run_id: str, note: str = "") -> str:
    return (f'<div class="dl-share">Link: <a data-run="{escape(run_id)}" href="?run={escape(run_id)}" '
            f'target="_blank">?run={escape(run_id)}</a> <small>{escape(note)}</small></div>')


def settings_values(s: Settings, share_prompt: bool, live: dict[str, dict]) -> list:
    """The controls' values, in app.py's `inputs` order, for a re-run; the draft proposer only where a replica
    still has a draft model."""
    has_draft = any(r.get("draft_model") for r in live.values())
    proposer = s.proposer if has_draft else "ngram"
    return [s.prompt, s.chat, s.system_prompt, s.max_tokens, s.model or gr.skip(), share_prompt, s.beam_width,
            s.length_penalty,
            s.beams_shown, s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.n, proposer, s.spec_k,
            s.constraint_type, s.constraint, s.compare_proposers and has_draft, s.pipeline, s.spec_adaptive]


CONTROLS = 22  # app.py's `inputs`: what settings_values fills


def cleared() -> tuple:
    """The share controls as before any Share: no link, nothing to download, no saved run to re-run."""
    return "", gr.DownloadButton(value=None, interactive=False), gr.Button(visible=False)


class ShareHandlers:
    def __init__(self, handlers: Handlers):
        self.h = handlers

    async def save(self, request: gr.Request):
        """Save the session's last run in Redis (link) and as a file (download): (link HTML, download button)."""
        run = self.h.runs.get(session_of(request))
        if run is None or not all(c.finished for c in run.all_columns()):
            note = "Run first, and let it finish." if run is None else "Wait for the run (and its branches) to end."
            return message_html(note), gr.DownloadButton(interactive=False)
        try:
            doc = share.saved_run(run)
            redis = self.h.service.client().redis
            run_id = await share.store(redis, self.h.service.keys, doc)
        except share.ShareError as e:
            return message_html(str(e)), gr.DownloadButton(interactive=False)
        except (TimeoutError, RedisError, OSError) as e:
            return message_html(f"share: Redis unreachable ({type(e).__name__})"), gr.DownloadButton(interactive=False)
        note = f"read-only, on any playground of this deployment, for {share.TTL_S // 86400} days"
        return link_html(run_id, note), gr.DownloadButton(value=_write_file(run_id, share.dumps(doc)),
                                                          interactive=True)

    def _show(self, doc: share.SavedRun, origin: str, request: gr.Request | None) -> tuple:
        """Make the saved run the session's and draw it: (message, 4 columns, kv, steps, trace, chart, run json)."""
        run = Run(self.h.service, doc.settings, doc.share_prompt, client_id="")
        share.restore(doc, run)
        run.shared = origin
        self.h._remember(session_of(request), run)
        return self.h._frame(run, {}, final=True)

    async def open_link(self, request: gr.Request):
        """On load: `?run=<id>` opens that saved run; (…frame, share HTML, re-run button)."""
        run_id = request.query_params.get("run") if request is not None else None
        if not run_id:
            return *[gr.skip()] * 10, gr.skip(), gr.skip()
        try:
            doc = await _fetch(self.h, run_id)
        except share.ShareError as e:
            return message_html(str(e)), *[gr.skip()] * 9, gr.skip(), gr.Button(visible=False)
        frame = self._show(doc, run_id, request)
        return *frame, link_html(run_id, _saved_note(doc)), gr.Button(visible=True)

    async def upload(self, path: str | None, request: gr.Request):
        """An uploaded run file, checked (version, shape, size): shown read-only, or a message saying why not."""
        try:
            if not path:
                raise share.ShareError("run file: nothing was uploaded")
            share.check_file_size(Path(path).stat().st_size)  # before reading it
            doc = share.loads(Path(path).read_bytes())
            frame = self._show(doc, Path(path).name, request)
        except share.ShareError as e:
            return message_html(str(e)), *[gr.skip()] * 9, gr.skip(), gr.skip()
        note = f"opened from a file · {_saved_note(doc)}"
        return *frame, f'<div class="dl-share"><small>{escape(note)}</small></div>', gr.Button(visible=True)

    async def rerun_values(self, request: gr.Request):
        """Re-run live, step one: the shown saved run's settings into the controls, the saved run's link and button
        away (step two is Run itself)."""
        run = self.h.runs.get(session_of(request))
        if run is None or not run.shared:
            return *[gr.skip()] * CONTROLS, gr.skip(), gr.skip()
        _, live = await self.h.service.health()
        return *settings_values(run.settings, run.share_prompt, live), "", gr.Button(visible=False)


async def _fetch(h: Handlers, run_id: str) -> share.SavedRun:
    try:
        return await asyncio.wait_for(share.fetch(h.service.client().redis, h.service.keys, run_id), REDIS_WAIT_S)
    except (TimeoutError, RedisError, OSError) as e:
        raise share.ShareError(f"run: Redis unreachable ({type(e).__name__}), the saved run cannot be read") from None


def _saved_note(doc: share.SavedRun) -> str:
    return "saved " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(doc.saved_at)) + " · read-only"


def _write_file(run_id: str, text: str) -> str:
    """The run as a file Gradio can serve; older downloads beyond KEEP_FILES go."""
    FILES_DIR.mkdir(parents=True, exist_ok=True)
    path = FILES_DIR / f"decodelab-run-{run_id}.json"
    path.write_text(text)
    old = sorted(FILES_DIR.glob("decodelab-run-*.json"), key=lambda p: p.stat().st_mtime)[:-KEEP_FILES]
    for p in old:
        p.unlink(missing_ok=True)
    return str(path)
