"""Gradio event handlers: Run (streams the four columns), Stop, branches (fork from a token, switch), and the
service/KV pulse (web/pulse.js asks for it)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict
from pathlib import Path
from urllib.parse import urlsplit

import gradio as gr

from web.branches import BranchError
from web.charts import summary_figure
from web.columns import Column, Token
from web.kv_panel import kv_panel_html
from web.modes import MODES, Settings, check_prompt
from web.render import column_html, message_html
from web.roofline import roofline_html
from web.session import STOP_GRACE_S, Run, Service
from web.trace import Trace, trace_html

MAX_SESSIONS = 1000
BYTES_PER_S = 400_000  # streaming budget per browser: big frames (long outputs with hover data) come less often


def _where(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname or '?'}:{parts.port or 6379}"  # never the password


def session_of(request: gr.Request | None) -> str:
    """The browser session an event came from ("" for a call without one): the key of its run."""
    return request.session_hash if request is not None else ""


def service_html(service: Service, ok: bool, live: dict[str, dict]) -> str:
    if not ok:
        return ('<div class="svc bad" role="alert"><span class="dot"></span>'
                f'Redis unreachable at {_where(service.redis_url)}</div>')
    if not live:
        return ('<div class="svc bad" role="alert"><span class="dot"></span>No engine replica connected '
                '(start <code>decodelab engine</code>; a model may still be loading)</div>')
    models = sorted({str(r.get("model") or "?") + (f' ({r["precision"]})' if r.get("precision") else "")
                     for r in live.values()})
    running = sum(int(r.get("running", 0)) for r in live.values())
    return (f'<div class="svc"><span class="dot"></span>{len(live)} replica{"s" if len(live) > 1 else ""} · '
            f'{", ".join(models)} · {running} running</div>')


def run_trace_html(run: Run, running: bool = False) -> str:
    """The probability trace of what each column shows (output 0 of its shown branch)."""
    return trace_html([Trace.of(m, run.trees[m].current.tokens()) for m in MODES], running=running)


def compare_control(live: dict[str, dict]) -> gr.Checkbox:
    """"Compare proposers" needs a replica with a draft model (its heartbeat's draft_model): else disabled, with why."""
    drafts = sorted({Path(str(r["draft_model"])).name for r in live.values() if r.get("draft_model")})
    if not drafts:
        return gr.Checkbox(value=False, interactive=False,
                           info="needs a replica with a draft model (decodelab engine --draft-model): none has one")
    return gr.Checkbox(interactive=True, info=f"n-gram and the draft model ({', '.join(drafts)}) on the same "
                                              "prompt, side by side")


def proposer_control(live: dict[str, dict]) -> gr.Radio:
    """The draft proposer is offered only when a replica has a draft model; n-gram always."""
    if any(r.get("draft_model") for r in live.values()):
        return gr.Radio(choices=["ngram", "draft"], info="n-gram: copy from the context; draft: a small model")
    return gr.Radio(choices=["ngram"], value="ngram",
                    info="n-gram: copy from the context (a draft model: no replica has one)")


class Handlers:
    def __init__(self, service: Service):
        self.service = service
        self.runs: OrderedDict[str, Run] = OrderedDict()  # per browser session: its latest run (for Stop, KV)

    @staticmethod
    def idle_column(mode: str) -> str:
        return column_html(Column(mode))

    def _remember(self, session: str, run: Run) -> None:
        self.runs[session] = run
        self.runs.move_to_end(session)
        while len(self.runs) > MAX_SESSIONS:
            self.runs.popitem(last=False)

    async def run(self, prompt, chat, system_prompt, max_tokens, model, share, beam_width, length_penalty,
                  beams_shown, temperature, top_k, top_p, min_p, seed, n, proposer, spec_k,
                  constraint_type, constraint, compare=False, pipeline=False, spec_adaptive=True,
                  request: gr.Request = None):
        settings = Settings(prompt=prompt or "", chat=bool(chat), system_prompt=system_prompt or "",
                            max_tokens=max_tokens, model=model or None, beam_width=beam_width,
                            length_penalty=length_penalty, beams_shown=beams_shown, temperature=temperature,
                            top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, n=n, proposer=proposer, spec_k=spec_k,
                            constraint_type=constraint_type or "none", constraint=constraint or "",
                            compare_proposers=bool(compare), pipeline=bool(pipeline),
                            spec_adaptive=bool(spec_adaptive))
        skip = gr.skip()
        if (error := check_prompt(settings)) is not None:
            yield message_html(error), *[skip] * 4, skip, skip, skip, skip, {"error": error}
            return
        ok, live = await self.service.health()
        if not ok or not live:
            error = ("Redis is unreachable: the playground cannot reach the engine." if not ok else
                     "No engine replica is connected to Redis, so nothing would answer. Start one "
                     "(decodelab engine, or decodelab play); a model may still be loading.")
            yield message_html(error), *[skip] * 4, skip, skip, skip, skip, {"error": error}
            return
        session = session_of(request)
        run = Run(self.service, settings, share_prompt=bool(share), client_id=(session or "")[:128])
        run.take_replicas(live)  # their roofs, for the engine-steps panel
        if (previous := self.runs.get(session)) is not None and not previous.finished:
            previous.stop()
        self._remember(session, run)
        try:
            seen: dict = {}
            first = True
            async for _ in run.updates():
                if self.runs.get(session) is run:  # else a newer Run stopped this one and draws the page
                    yield self._frame(run, seen, clear=first)
                    first = False
            if self.runs.get(session) is not run:  # its data alone: the API's answer; nothing on the page
                yield *[gr.skip()] * (len(MODES) + 5), self._data(run)
                return
            if previous is not None and previous.shared is None:  # the run this one replaced answers first, so
                with contextlib.suppress(asyncio.TimeoutError):  # that its data never lands over this one's
                    await asyncio.wait_for(previous.answered.wait(), STOP_GRACE_S + 2.0)
            yield self._frame(run, seen, final=True)
        finally:
            run.answered.set()

    def _frame(self, run: Run, seen: dict, clear: bool = False, final: bool = False) -> tuple:
        cols = run.columns
        k = int(run.settings.spec_k or 1)
        htmls = []
        for m in MODES:
            spec = m == "speculative"
            version = (run.trees[m].version, cols["greedy"].version if spec else 0,
                       run.rival.version if spec and run.rival else 0)
            drawn = seen.get(m)
            if drawn is not None and drawn[0] == version:
                # unchanged: the last frame (what the API returns) has every column, as the same string with its
                # old stamp, so the page does not redraw it (a hover card stays) nor put it over a newer drawing
                htmls.append(drawn[1] if final else gr.skip())
                continue
            html = column_html(cols[m], cols["greedy"], k, run.trees[m], run.rival if spec else None)
            seen[m] = (version, html)
            htmls.append(html)
        kv = kv_panel_html(run.kv, run.owners(), run.kv_peak, running=not final)
        if kv == seen.get("kv") and not final:
            kv = gr.skip()
        else:
            seen["kv"] = kv
        steps = roofline_html(run.step_lists(), run.roofs, running=not final)
        if steps == seen.get("steps") and not final:
            steps = gr.skip()
        else:
            seen["steps"] = steps
        trace = run_trace_html(run, running=not final)
        if trace == seen.get("trace") and not final:
            trace = gr.skip()
        else:
            seen["trace"] = trace
        run.pace = sum(len(x) for x in (*htmls, kv, steps, trace) if isinstance(x, str)) / BYTES_PER_S
        if final:
            msg = message_html(run.message) if run.message else ""
            fig = summary_figure([cols[m] for m in MODES])
            return msg, *htmls, kv, steps, trace, fig, self._data(run)
        msg = message_html(run.message) if run.message else ""
        return msg, *htmls, kv, steps, trace, (None if clear else gr.skip()), gr.skip()

    @staticmethod
    def _data(run: Run) -> dict:
        """The run's data: the last output of a run's final frame (the page's "Run data", the API's answer)."""
        cols = run.columns
        return {"columns": {m: c.summary() for m, c in cols.items()}, "message": run.message,
                "kv": run.kv[0].stats if run.kv else None,
                "proposers": None if run.rival is None else {  # compare proposers: both speculative runs
                    c.request.params.proposer: c.summary() for c in (cols["speculative"], run.rival)}}

    async def stop(self, request: gr.Request):
        run = self.runs.get(session_of(request))
        if run is not None and run.loop is not None and not all(c.finished for c in run.all_columns()):
            run.loop.call_soon_threadsafe(run.stop)

    # ---- branches: the page's script (web/branching.js) sends {"op", "mode", "branch", "pos", "token_id", "text"}
    def _column(self, run: Run, mode: str) -> list:
        return [column_html(run.columns[m], run.columns["greedy"], int(run.settings.spec_k or 1), run.trees[m],
                            run.rival if m == "speculative" else None)
                if m == mode else gr.skip() for m in MODES]

    async def fork(self, cmd: str, request: gr.Request):
        """Branch a column from a token and stream the branch (its column, the KV panel) until it ends."""
        session = session_of(request)
        run, skip = self.runs.get(session), gr.skip()
        try:
            c = _command(cmd)
            if run is None:
                raise BranchError("Run first, then click a token to branch from it.")
            if run.shared:
                raise BranchError("This is a saved run, read-only: Re-run it live to branch from its tokens.")
            parent = run.trees[c["mode"]].get(c["branch"])
            shown = parent.tokens()
            alts = {tid: lp for tid, _, lp in shown[c["pos"]].top} if c["pos"] < len(shown) else {}
            picked = Token(c["text"], c["token_id"], alts.get(c["token_id"]))
            branch = run.fork(c["mode"], c["branch"], c["pos"], picked)
        except (BranchError, ValueError, KeyError, TypeError) as e:
            yield message_html(str(e)), *[skip] * len(MODES), skip, skip, skip
            return
        kv_at = 0.0
        async with contextlib.aclosing(run.follow(branch)) as updates:
            async for _ in updates:
                if self.runs.get(session) is not run:
                    return  # a new Run replaced this one: stop drawing (closing `updates` cancels the branch)
                kv = steps = skip
                if time.monotonic() - kv_at > 0.5 or branch.column.finished:
                    kv_at = time.monotonic()
                    run.take_kv(await self.service.kv())
                    await run.take_steps()  # the branch's steps join the run's
                    kv = kv_panel_html(run.kv, run.owners(), run.kv_peak, running=not branch.column.finished)
                    steps = roofline_html(run.step_lists(), run.roofs, running=not branch.column.finished)
                yield "", *self._column(run, c["mode"]), kv, steps, run_trace_html(run)

    async def switch(self, cmd: str, request: gr.Request):
        """Show another branch of a column: its tokens are kept in the session, nothing runs."""
        run = self.runs.get(session_of(request))
        try:
            c = _command(cmd)
            if run is None:
                raise BranchError("nothing to switch: run first")
            run.trees[c["mode"]].switch(c["branch"])
        except (BranchError, ValueError, KeyError, TypeError):
            return [gr.skip()] * (len(MODES) + 1)
        return [*self._column(run, c["mode"]), run_trace_html(run)]

    async def pulse(self, session: str) -> tuple[str, str | None]:
        """The page's pulse (web/pulse.js asks once a second): the service pill, and the KV panel unless the
        session's run draws it (a live run's own frames; a saved run shows its own): then None."""
        ok, live = await self.service.health()
        status = service_html(self.service, ok, live)
        run = self.runs.get(session)
        if run is not None and (not run.finished or run.shared):
            return status, None
        return status, await self._kv_html(run)

    async def _kv_html(self, run: Run | None) -> str:
        owners = run.owners() if run else {}
        return kv_panel_html(await self.service.kv(), owners, run.kv_peak if run else None, running=False)

    async def load(self, request: gr.Request):
        ok, live = await self.service.health()
        models = sorted({str(r["model"]) for r in live.values() if r.get("model")})
        dropdown = gr.Dropdown(choices=models, value=models[0] if len(models) == 1 else None)
        return (service_html(self.service, ok, live), await self._kv_html(None), dropdown, compare_control(live),
                proposer_control(live), session_of(request))

    async def unload(self, request: gr.Request):
        run = self.runs.pop(session_of(request), None)
        if run is not None and run.loop is not None and not all(c.finished for c in run.all_columns()):
            run.loop.call_soon_threadsafe(run.stop)


def _command(cmd: str) -> dict:
    """The script's JSON command, checked: ValueError (shown under the prompt) when malformed."""
    try:
        c = json.loads(cmd or "{}")
    except json.JSONDecodeError:
        raise ValueError("branch: malformed command") from None
    if not isinstance(c, dict) or c.get("mode") not in MODES:
        raise ValueError("branch: unknown column")
    text = str(c.get("text") or "")[:200]
    token_id = c.get("token_id")
    return {"mode": c["mode"], "branch": int(c.get("branch") or 0), "pos": int(c.get("pos") or 0),
            "token_id": int(token_id) if token_id is not None else None, "text": text}
