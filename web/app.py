"""The Gradio playground: one prompt, four decoding modes side by side, the KV cache live (`decodelab web`).

It speaks to the engine only through Redis (shared/); handlers live in web/handlers.py, HTML in render/kv_panel.
"""
from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no phoning home (and no version check)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections.abc import Awaitable, Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import gradio as gr  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from web import handlers, share, share_view  # noqa: E402
from web.head_first import HeadFirst  # noqa: E402
from web.modes import CONSTRAINTS, MAX_TOKENS_LIMIT, MODES, Settings  # noqa: E402
from web.roofline import roofline_html  # noqa: E402
from web.session import Service  # noqa: E402
from web.trace import trace_html  # noqa: E402

CSS_PATH = Path(__file__).with_name("style.css")
JS_PATH = Path(__file__).with_name("branching.js")  # click a token: its alternatives, pick one to branch
TIPS_PATH = Path(__file__).with_name("tips.js")  # hover a token: its card, drawn from its data-* facts on demand
PIPELINE_PATH = Path(__file__).with_name("pipeline.js")  # click a traced token: its sampler pipeline and a what-if
FRAMES_PATH = Path(__file__).with_name("frames.js")  # first in <head>: Gradio's status-tracker timers off the frames
# the streamed outputs draw themselves, only what changed (Gradio 6 redraws an HTML value whole on every frame)
DRAW_JS = Path(__file__).with_name("draw.js").read_text()
PULSE_JS = Path(__file__).with_name("pulse.js").read_text()
# the shading is the stylesheet's choice (style.css): no round trip, no re-render
SHADE_JS = "(v) => { document.documentElement.dataset.shade = v; return []; }"
DEFAULTS = Settings()
# Gradio's queue looks for work every 1 ms while it has none, and all through a run (its `sleep_when_free`, Linux):
# ~900 wake-ups a second, 5-6% of one of the box's two cores with no page open. 10 ms is far below what a click
# can tell. It looks for progress updates (gr.Progress, which no event here reports) every 10 ms: 100 here.
QUEUE_POLL_S = 0.01
PROGRESS_POLL_S = 0.1
INTRO = ("<h1>DecodeLab</h1><p>One prompt, four ways to decode it, streamed side by side from one engine batch. "
         "The warmer a token's shade, the less likely it was: hover it for its probability and the top alternatives, "
         "click it to branch from there with another token. Below, the KV cache the four requests share.</p>")
HEADERS = {
    "greedy": ("Greedy", "Takes the most likely token at every step. Deterministic: the baseline."),
    "beam": ("Beam search",
             "Keeps the <i>width</i> best partial answers, ranked by log-probability / length<sup>α</sup>."),
    "sample": ("Sampling", "Draws each token from the distribution, reshaped by temperature, top-k, top-p and min-p."),
    "speculative": ("Speculative", "A cheap proposer drafts k tokens, the model checks them in one pass. "
                                   "Same text as greedy, fewer steps."),
}
PERSON_SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},\n'
                 ' "required": ["name", "age"]}')
REPEAT_PROMPT = ("Repeat the following text exactly, word for word:\n\nThe Moon is Earth's only natural satellite. "
                 "It orbits at an average distance of 384,400 km, about 30 times the diameter of Earth. The Moon "
                 "always shows the same side to Earth, because its rotation is locked to its orbit.")
EXAMPLES = [  # (chip label, prompt, chat template?, system prompt, constraint type, constraint)
    ("Why is the sky blue?", "Explain in three sentences why the sky is blue.", True, "", "none", ""),
    ("The planets, one per line", "List the planets of the solar system, one per line, with one fact about each.",
     True, "", "none", ""),
    ("A haiku (with a system prompt)", "Write a haiku about a robot learning to paint.", True,
     "You are a poet who writes short, vivid verse.", "none", ""),
    ("Plain completion: primary colours", "The three primary colours are", False, "", "none", ""),
    ("Code completion: fibonacci", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False, "",
     "none", ""),
    ("JSON schema: a person", "Invent a person: give their name and age as JSON.", True, "", "JSON schema",
     PERSON_SCHEMA),
    # the model copies its context: the n-gram proposer drafts it (SmolLM2 int8 accepts ~88% of 4 drafts here)
    ("Speculation shines: repeat a text", REPEAT_PROMPT, True, "", "none", ""),
]
CONSTRAINT_INFO = "every column's output must match it (the engine masks the tokens that would break it)"


def theme() -> gr.themes.Base:
    # System fonts only: the default theme would fetch Google Fonts, which an offline machine cannot reach.
    return gr.themes.Soft(primary_hue="indigo", neutral_hue="slate",
                          font=["ui-sans-serif", "system-ui", "Segoe UI", "Roboto", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "monospace"])


def _mode_header(mode: str) -> None:
    title, text = HEADERS[mode]
    gr.HTML(f"<h3>{title}</h3><p>{text}</p>", elem_classes=["mode-head"])


def _drawn(value: str = "", **kw) -> gr.HTML:
    """An HTML output the page draws itself (web/draw.js): what a stream updates every frame."""
    return gr.HTML(value, html_template="", js_on_load=DRAW_JS, **kw)


def _example(i: int) -> tuple:
    """An example fills the prompt's controls and the constraint; one with a constraint opens its accordion."""
    example = EXAMPLES[i]
    return *example[1:], (gr.Accordion(open=True) if example[4] != "none" else gr.skip())


def build_app(service: Service) -> gr.Blocks:
    h = handlers.Handlers(service)
    with gr.Blocks(title="DecodeLab playground", analytics_enabled=False) as demo:
        with gr.Row(equal_height=True):
            gr.HTML(INTRO, elem_id="dl-title")
            service_html = _drawn(elem_id="dl-service")
            # the page's pulse: the load gives it the session, web/pulse.js then redraws the pill and the KV panel
            pulse = gr.HTML("", html_template="", js_on_load=PULSE_JS, elem_id="dl-pulse", visible="hidden")
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox("", label="Prompt", lines=2, max_lines=12, elem_id="prompt",
                                    placeholder="Ask something, or pick an example below")
                with gr.Row(equal_height=True):
                    chat = gr.Checkbox(DEFAULTS.chat, label="Chat template", elem_id="chat", scale=1,
                                       info="wrap it in the model's chat template")
                    share = gr.Checkbox(True, label="Share the prompt's KV blocks", elem_id="share", scale=1,
                                        info="greedy prefills first, the others hit the prefix cache")
                    system = gr.Textbox("", label="System prompt (optional, chat template only)", lines=1, scale=2,
                                        elem_id="system")
            with gr.Column(scale=1, min_width=260):
                model = gr.Dropdown(label="Model", choices=[""], value="", allow_custom_value=True, elem_id="model",
                                    info="served by the replicas connected to Redis")
                max_tokens = gr.Slider(1, MAX_TOKENS_LIMIT, value=DEFAULTS.max_tokens, step=1, label="Max tokens",
                                       elem_id="max-tokens")
                shade = gr.Radio(["probability", "entropy", "grammar mask"], value="probability",
                                 label="Shade tokens by", elem_id="shade",
                                 info="1 - p of the token, the entropy of its distribution, or the probability "
                                      "a constraint's grammar removed there")
                with gr.Row():
                    run_btn = gr.Button("Run", variant="primary", elem_id="run")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                with gr.Row():  # web/share_view.py: a link, a file, and back to live
                    share_btn = gr.Button("Share", size="sm", elem_id="share-run")
                    download_btn = gr.DownloadButton("Download", size="sm", interactive=False, elem_id="download-run")
                    upload_btn = gr.UploadButton("Open file", size="sm", file_types=[".json"], type="filepath",
                                                 elem_id="upload-run")
                share_html = gr.HTML(elem_id="dl-share")
                rerun_btn = gr.Button("Re-run live", size="sm", variant="primary", visible=False, elem_id="rerun")
        with (gr.Accordion("Constraint (structured output, all four columns)", open=False,
                           elem_id="constraint") as constraint_box,
              gr.Row(equal_height=True)):
            constraint_type = gr.Radio(list(CONSTRAINTS), value=DEFAULTS.constraint_type, label="Constrain to",
                                       info=CONSTRAINT_INFO, elem_id="constraint-type", scale=1)
            constraint = gr.Textbox("", label="JSON schema, regex, or the choices one per line", lines=3,
                                    max_lines=12, elem_id="constraint-text", scale=2)
        examples = gr.Dataset(components=["textbox"], samples=[[e[0]] for e in EXAMPLES], type="index",
                              label="Examples", layout="gallery", elem_id="examples")
        message = gr.HTML(elem_id="dl-message")

        with gr.Row(equal_height=False):
            with gr.Column(elem_id="col-greedy", min_width=220):
                _mode_header("greedy")
                gr.HTML('<p class="dim" style="font-size:.8rem">No knobs: argmax, temperature 0.</p>')
            with gr.Column(elem_id="col-beam", min_width=220):
                _mode_header("beam")
                with gr.Row():
                    beam_width = gr.Slider(1, 8, value=DEFAULTS.beam_width, step=1, label="Width", elem_id="beam-width")
                    beams_shown = gr.Slider(1, 8, value=DEFAULTS.beams_shown, step=1, label="Beams shown",
                                            elem_id="beams-shown")
                length_penalty = gr.Slider(-1.0, 3.0, value=DEFAULTS.length_penalty, step=0.1,
                                           label="Length penalty α", elem_id="length-penalty")
            with gr.Column(elem_id="col-sample", min_width=220):
                _mode_header("sample")
                with gr.Row():
                    temperature = gr.Slider(0.0, 2.0, value=DEFAULTS.temperature, step=0.05, label="Temperature",
                                            elem_id="temperature")
                    top_p = gr.Slider(0.05, 1.0, value=DEFAULTS.top_p, step=0.05, label="Top-p", elem_id="top-p")
                with gr.Row():
                    top_k = gr.Number(DEFAULTS.top_k, precision=0, label="Top-k (-1: off)", elem_id="top-k")
                    min_p = gr.Slider(0.0, 0.5, value=DEFAULTS.min_p, step=0.01, label="Min-p", elem_id="min-p")
                with gr.Row():
                    seed = gr.Number(DEFAULTS.seed, precision=0, label="Seed (empty: random)", elem_id="seed")
                    n = gr.Slider(1, 4, value=DEFAULTS.n, step=1, label="n samples", elem_id="n")
                pipeline = gr.Checkbox(DEFAULTS.pipeline, label="Sampler pipeline", elem_id="sampler-pipeline",
                                       info="click a sampled token: its distribution stage by stage, "
                                            "and a what-if")
            with gr.Column(elem_id="col-speculative", min_width=220):
                _mode_header("speculative")
                proposer = gr.Radio(["ngram", "draft"], value=DEFAULTS.proposer, label="Proposer",
                                    info="n-gram: copy from the context; draft: a small model", elem_id="proposer")
                spec_k = gr.Slider(1, 8, value=DEFAULTS.spec_k, step=1, label="k (tokens drafted per step)",
                                   elem_id="spec-k")
                spec_adaptive = gr.Checkbox(DEFAULTS.spec_adaptive, label="Adaptive k", elem_id="spec-adaptive",
                                            info="Hugging Face's schedule: 2 more drafts after a step that kept "
                                                 "all, 1 fewer after a rejection (1 to k)")
                # enabled on load when a replica has a draft model (handlers.compare_control)
                compare = gr.Checkbox(DEFAULTS.compare_proposers, label="Compare proposers", interactive=False,
                                      elem_id="compare-proposers", info="needs a replica with a draft model")
        with gr.Row(equal_height=False):
            outs = [_drawn(h.idle_column(m), elem_id=f"out-{m}", min_width=220) for m in MODES]
        gr.HTML('<div class="sect">Probability trace <small>the chosen token\'s probability along each column\'s '
                'text, and the entropy of its distribution</small></div>')
        trace = _drawn(trace_html([]), elem_id="trace")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                gr.HTML('<div class="sect">KV cache</div>')
                kv = _drawn(elem_id="kv")
            with gr.Column(scale=2, min_width=320):
                gr.HTML('<div class="sect">Summary of the last run</div>')
                chart = gr.Plot(show_label=False, elem_id="chart")
                gr.HTML('<div class="sect">Engine steps (prefill vs decode) <small>on this machine\'s roofline'
                        '</small></div>')
                steps = _drawn(roofline_html({}, {}), elem_id="steps")
        with gr.Accordion("Run data (JSON, also what the API returns)", open=False):
            run_json = gr.JSON(elem_id="run-json")
        # branches: the page script puts its command in window.dlBranchCmd and clicks one of these hidden buttons
        branch_cmd = gr.Textbox(visible="hidden", elem_id="branch-cmd")
        fork_btn = gr.Button(visible="hidden", elem_id="branch-fork")
        switch_btn = gr.Button(visible="hidden", elem_id="branch-switch")

        inputs = [prompt, chat, system, max_tokens, model, share, beam_width, length_penalty, beams_shown,
                  temperature, top_k, top_p, min_p, seed, n, proposer, spec_k, constraint_type, constraint, compare,
                  pipeline, spec_adaptive]
        # multiple: a Run clicked during a run starts the new one at once and stops the old (h.run). Gradio's
        # default ("once") would drop that click, and "always_last" would start it only when the old run ends,
        # minutes later at 1024 tokens, and even after Stop (the page holds the deferred click)
        run_event = run_btn.click(h.run, inputs, [message, *outs, kv, steps, trace, chart, run_json], api_name="run",
                                  concurrency_limit=None, show_progress="hidden", trigger_mode="multiple")
        prompt.submit(h.run, inputs, [message, *outs, kv, steps, trace, chart, run_json], api_name=False,
                      concurrency_limit=None, show_progress="hidden", trigger_mode="multiple")
        examples.click(_example, examples, [prompt, chat, system, constraint_type, constraint, constraint_box],
                       api_name=False, queue=False)
        stop_btn.click(h.stop, None, None, api_name="stop", concurrency_limit=None, queue=False)
        del run_event
        read_cmd = "(x) => [window.dlBranchCmd || x || '']"
        fork_btn.click(h.fork, branch_cmd, [message, *outs, kv, steps, trace], js=read_cmd, api_name="fork",
                       trigger_mode="multiple", concurrency_limit=None, show_progress="hidden")
        switch_btn.click(h.switch, branch_cmd, [*outs, trace], js=read_cmd, api_name=False, trigger_mode="multiple",
                         queue=False, show_progress="hidden")
        shade.change(None, shade, None, js=SHADE_JS, api_name=False, queue=False)
        loaded = demo.load(h.load, None, [service_html, kv, model, compare, proposer, pulse], api_name=False,
                           queue=False)
        _share_events(share_view.ShareHandlers(h), inputs, [message, *outs, kv, steps, trace, chart, run_json],
                      share_btn, download_btn, upload_btn, share_html, rerun_btn, loaded)
        # a new run: the last one's link, file and re-run button go (Share saves the new one)
        gr.on([run_btn.click, prompt.submit], share_view.cleared, None, [share_html, download_btn, rerun_btn],
              api_name=False, queue=False)
        demo.unload(h.unload)
    demo.dl_pulse = h.pulse  # served by launch() at dl/pulse, outside Gradio's events (web/pulse.js)
    return demo


def _share_events(s: share_view.ShareHandlers, inputs: list, frame: list, share_btn: gr.Button,
                  download_btn: gr.DownloadButton, upload_btn: gr.UploadButton, share_html: gr.HTML,
                  rerun_btn: gr.Button, loaded) -> None:
    """Share (a link and a download), open a link (`?run=`) or a file read-only, re-run it live in one click."""
    share_btn.click(s.save, None, [share_html, download_btn], api_name=False, concurrency_limit=None).then(
        None, js=share_view.LINK_JS)
    # after the page's own load, so that its live KV panel does not land over the saved run's
    loaded.then(s.open_link, None, [*frame, share_html, rerun_btn], api_name=False, concurrency_limit=None).then(
        None, js=share_view.LINK_JS)
    upload_btn.upload(s.upload, upload_btn, [*frame, share_html, rerun_btn], api_name=False, concurrency_limit=None)
    rerun_btn.click(s.rerun_values, None, [*inputs, share_html, rerun_btn], api_name=False, queue=False).then(
        s.h.run, inputs, frame, api_name=False, concurrency_limit=None, show_progress="hidden")


def page_js() -> str:
    """The page's scripts as the one function Gradio runs on load."""
    scripts = (JS_PATH, TIPS_PATH, PIPELINE_PATH)
    return "() => { " + " ".join(f"({p.read_text()})();" for p in scripts) + " }"


def _pulse_endpoint(pulse: Callable[[str], Awaitable[tuple[str, str | None]]]):
    """GET dl/pulse?session=...: {"service": the pill's HTML, "kv": the KV panel's, or null where the session's run
    draws it}. A plain route, not a Gradio event: a gr.Timer's tick walked every component's loading status and
    cloned their state in the page, ~5% of a core of an idle page's Chromium (docs/playground.md)."""
    async def endpoint(request: Request) -> JSONResponse:
        service, kv = await pulse(request.query_params.get("session", "")[:128])
        return JSONResponse({"service": service, "kv": kv}, headers={"Cache-Control": "no-store"})
    return endpoint


def launch(demo: gr.Blocks, host: str, port: int, **kw):
    demo.queue(default_concurrency_limit=None, max_size=256)
    demo._queue.sleep_when_free = QUEUE_POLL_S
    demo._queue.progress_update_sleep_when_free = PROGRESS_POLL_S
    # uploads are run files only: Gradio refuses anything far past their cap before it reaches the disk.
    # run_history off: Gradio 6 kept each run's outputs (every frame's column HTML) in the browser's localStorage
    # and re-parsed the whole history every 500 ms of a stream: Chromium's CPU a run doubled against the engine's
    # over 25 runs on one page, and TPOT rose to ~100 ms by runs 22-29 of 30 (docs/benchmarks.md). Share keeps runs.
    head_first = Middleware(HeadFirst, script=FRAMES_PATH.read_text())
    routes = [Route("/dl/pulse", _pulse_endpoint(demo.dl_pulse))]
    return demo.launch(server_name=host, server_port=port, theme=theme(), css_paths=[CSS_PATH], ssr_mode=False,
                       app_kwargs={"middleware": [head_first], "routes": routes}, js=page_js(), show_error=True,
                       quiet=kw.pop("quiet", False), run_history=False,
                       max_file_size=2 * share.MAX_FILE_BYTES, **kw)

