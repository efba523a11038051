"""`decodelab bench playground`: the four-mode example as a person meets it, three ways.

1. browser: the stack `decodelab play` starts (private Redis, one replica, the web UI), a headless Chromium on the
   page; the example prompt, the four columns at their defaults, Run. Per column, what the page shows: time from
   the click to the column's first token on screen (TTFT), then to the column's end, per token after the first
   (TPOT); the run's wall time, click to the last column done; and the CPU seconds each process spent on the run
   (the engine replica, the web UI, Chromium's processes; psutil), the web's also per token on screen.
2. api: the same four requests (web/modes.py builds them) through the replica's OpenAI API, concurrently, streaming,
   no browser: TTFT and TPOT per request as the HTTP client sees them.
3. in-process: the same four requests in one LLMEngine, timed around engine.step() as the API path is timed.
4. breakdown: one decode step's ms split into linears, attention, the fused layer stack, the rest of the model,
   input preparation, sampler and the rest (engine_service/bench/step_profile.py), for the greedy request alone
   (batch 1) and for the four requests together, in one LLMEngine.
The API streams a beam request's outputs once final (an append-only stream cannot show beams overtaking each
other), so there its TTFT is the whole run and it has no TPOT.
The paths take turns, run by run (a round: browser, api, in-process), with the stack and the in-process engine both
loaded throughout (each idle while another path runs): a shared VM's speed can drift by ~25% over minutes (a 2-core
AMD EPYC, session 39), more than what the page or the API adds to the engine: paths measured one after another
compared windows, not paths. `same_window` in the JSON: per mode, the median over rounds of a path's TPOT over
the in-process one's.
Every path runs play's configuration unless told otherwise (server/play.apply_play_defaults: on a CPU int8 weights
and one core left to the web UI and the browser, `--threads` cores - 1; the stack's OpenMP threads sleep while
they wait, OMP_WAIT_POLICY=PASSIVE).
Medians over --repeats runs of each. Writes benchmarks/results/playground.json and playground.png; with --pipeline
(the "Sampler pipeline" box ticked: greedy and sampling carry each token's stages to the page) playground-pipeline.*.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time

from engine_service.bench.common import cpu_info, median, pyplot, write_results

PROMPT = "Why is the sky blue?"
MODES = ("greedy", "beam", "sample", "speculative")
CHROMIUM = "/usr/bin/chromium"
FINAL = ("done", "error", "cancelled", "invalid")

# Timestamps the page itself records (performance.now(), ms): a column's first token on screen and its end.
WATCH_JS = """([modes, final]) => {
  const t = {t0: performance.now(), started: {}, first: {}, done: {}, tokens: {}, status: {}};
  window.__dl = t;
  if (window.__dlWatch) window.__dlWatch.disconnect();  // the last run's: one observer a page, not one a run
  const look = () => {
    for (const m of modes) {
      const col = document.querySelector('#out-' + m + ' .dl-col');
      if (!col) continue;
      // the main output's tokens only (not other beams or samples, not the speculative legend)
      const main = col.querySelector(':scope > .txt');
      const n = main ? main.querySelectorAll('.tk').length : 0;
      // the previous run's columns are still final at the click: a column counts once it has left that state
      if (!final.includes(col.dataset.status)) t.started[m] = true;
      if (!t.started[m]) continue;
      if (n > 0 && !(m in t.first)) t.first[m] = performance.now();
      if (final.includes(col.dataset.status) && !(m in t.done)) {
        t.done[m] = performance.now(); t.tokens[m] = n; t.status[m] = col.dataset.status;
      }
    }
  };
  window.__dlWatch = new MutationObserver(look);
  window.__dlWatch.observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true});
}"""


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("playground", help="the four-mode playground run: browser, OpenAI API, in-process")
    add_engine_args(p)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paths", default="browser,api,inprocess,breakdown",
                   help="which of browser, api, inprocess, breakdown to run")
    p.add_argument("--engine-port", type=int, default=8011)
    p.add_argument("--web-port", type=int, default=7871)
    p.add_argument("--pipeline", action="store_true",
                   help="with the 'Sampler pipeline' box ticked (greedy and sampling report each token's sampler "
                        "stages; the OpenAI API path has no such field): writes playground-pipeline.json")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


def _requests(args) -> dict:
    from web.modes import Settings, build_request

    settings = Settings(prompt=args.prompt, max_tokens=args.max_tokens, pipeline=getattr(args, "pipeline", False))
    return {m: build_request(m, settings) for m in MODES}


def _summary(runs: list[dict]) -> dict:
    """Per mode: median TTFT / TPOT (ms) and tokens over the runs; the run's median wall time."""
    out = {"wall_s": median([r["wall_s"] for r in runs]), "runs": runs, "modes": {}}
    if runs and "cpu_s" in runs[0]:  # the browser path: CPU seconds per process group, medians
        out["cpu_s"] = {k: median([r["cpu_s"][k] for r in runs]) for k in runs[0]["cpu_s"]}
        out["web_cpu_ms_per_token"] = median([r["web_cpu_ms_per_token"] for r in runs])
    for m in MODES:
        got = [r["modes"][m] for r in runs if m in r["modes"]]
        out["modes"][m] = {k: median([g[k] for g in got if g.get(k) is not None] or [float("nan")])
                           for k in ("ttft_ms", "tpot_ms", "tokens")}
    return out


# ---- 1. the browser on the page, against the stack `play` starts
def _stack(args):
    from engine_service.engine.flags import engine_argv
    from engine_service.server.play import Stack, stack_env, wait_ready
    from engine_service.server.redis_server import RedisServer

    stack = Stack()
    stack.redis = RedisServer().start()
    env = stack_env(stack.redis.url, args.threads)
    engine_url, web_url = f"http://127.0.0.1:{args.engine_port}", f"http://127.0.0.1:{args.web_port}"
    stack.spawn("engine", [sys.executable, "-m", "engine_service.cli", "engine", *engine_argv(args),
                           "--port", str(args.engine_port), "--served-model-name", "playground"], env)
    stack.spawn("web", [sys.executable, "-m", "engine_service.cli", "web", "--port", str(args.web_port)], env)
    import threading

    never = threading.Event()
    wait_ready(f"{engine_url}/ready", stack, 600, never)
    wait_ready(web_url, stack, 600, never)
    return stack, engine_url, web_url


def _cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """user + system CPU seconds so far, per named group of processes (gone ones count 0)."""
    import psutil

    out = {}
    for name, group in pids.items():
        total = 0.0
        for pid in group:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        out[name] = total
    return out


def _chromium_pids(profile: str) -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"]) if any(profile in a for a in p.info["cmdline"] or [])]


class _Browser:
    """Headless Chromium on the page of play's stack; `run(i)` is one click of Run, timed as the page shows it."""

    def __init__(self, args, web_url: str, server_pids: dict[str, list[int]]):
        self.args, self.web_url, self.server_pids = args, web_url, server_pids

    def __enter__(self) -> _Browser:
        from playwright.sync_api import sync_playwright

        with contextlib.ExitStack() as opened:  # closed here if the page fails to come up, else in __exit__
            profile = opened.enter_context(tempfile.TemporaryDirectory(prefix="decodelab-bench-chromium-"))
            pw = opened.enter_context(sync_playwright())
            ctx = pw.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, viewport={"width": 1600, "height": 1000},
                args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                      "--disable-background-networking"])
            opened.callback(ctx.close)
            page = self.page = ctx.new_page()
            page.goto(self.web_url)
            page.wait_for_selector("#run")
            page.locator("#prompt textarea").fill(self.args.prompt)
            box = page.locator("#max-tokens input[type=number]")
            box.fill(str(self.args.max_tokens))
            box.press("Tab")
            if getattr(self.args, "pipeline", False):
                page.locator("#sampler-pipeline input[type=checkbox]").check()
            self.pids = {**self.server_pids, "chromium": _chromium_pids(profile)}
            self._exit = opened.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._exit.close()

    def run(self, i: int) -> dict:
        page = self.page
        page.evaluate(WATCH_JS, [list(MODES), list(FINAL)])
        cpu0 = _cpu_seconds(self.pids)
        page.locator("#run").click()
        # polled on a timer: requestAnimationFrame callbacks may not run in a headless page
        page.wait_for_function("(modes) => modes.every(m => m in window.__dl.done)", arg=list(MODES),
                               polling=200, timeout=600_000)
        t = page.evaluate("window.__dl")
        cpu = {k: v - cpu0[k] for k, v in _cpu_seconds(self.pids).items()}
        modes = {}
        for m in MODES:
            first, done, n = t["first"].get(m), t["done"][m], t["tokens"][m]
            modes[m] = {"status": t["status"][m], "tokens": n,
                        "ttft_ms": first - t["t0"] if first is not None else None,
                        "tpot_ms": (done - first) / (n - 1) if first is not None and n > 1 else None}
        shown = sum(modes[m]["tokens"] for m in MODES)  # the four main texts' tokens on screen
        out = {"wall_s": (max(t["done"].values()) - t["t0"]) / 1e3, "modes": modes, "cpu_s": cpu,
               "web_cpu_ms_per_token": cpu["web"] * 1e3 / max(1, shown)}
        print(f"browser run {i}{' (warm-up)' if i == 0 else ''}: wall {out['wall_s']:.2f} s  " + "  ".join(
            f"{m} tpot {modes[m]['tpot_ms'] or float('nan'):.0f} ms" for m in MODES) + "  cpu s " + "  ".join(
            f"{k} {v:.2f}" for k, v in cpu.items()), flush=True)
        return out


# ---- 2. the OpenAI API, no browser
async def _api_once(engine_url: str, requests: dict) -> dict:
    import httpx

    async def one(mode: str, req) -> dict:
        p = req.params
        body = {"model": "playground", "messages": [m.model_dump() for m in req.messages], "stream": True,
                "logprobs": True, "top_logprobs": p.logprobs,
                **p.model_dump(exclude={"logprobs", "stop", "sampler_stages"})}  # not an OpenAI API field
        t0, first, last, tokens = time.perf_counter(), None, None, 0
        async with httpx.AsyncClient(timeout=600) as http, http.stream(
                "POST", f"{engine_url}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    if choice["index"] != 0:
                        continue
                    n = len((choice.get("logprobs") or {}).get("content") or [])
                    if n:
                        now = time.perf_counter()
                        first, last, tokens = first or now, now, tokens + n
        return {"tokens": tokens, "ttft_ms": (first - t0) * 1e3 if first else None,
                "tpot_ms": (last - first) * 1e3 / (tokens - 1) if first and tokens > 1 else None}

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(m, r) for m, r in requests.items()))
    return {"wall_s": time.perf_counter() - t0, "modes": dict(zip(requests, results))}


def _in_thread(fn):
    """fn() on a thread of its own: Playwright's sync API keeps an event loop running on this one, so asyncio.run
    here would refuse."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


# ---- 3. in-process
class _InProcess:
    """The four requests in one LLMEngine of this process; `run(i)` is one run, timed around engine.step() as the
    API path is timed."""

    def __init__(self, args, requests: dict):
        from engine_service.engine.flags import engine_config_from_args
        from engine_service.engine.llm_engine import LLMEngine

        self.requests = requests
        self.engine = LLMEngine(engine_config_from_args(args))
        self.prompt = self.engine.tokenizer.apply_chat_template(
            [m.model_dump() for m in requests["greedy"].messages], tokenize=False, add_generation_prompt=True)

    def run(self, i: int) -> dict:
        from engine_service.engine.sampling_params import SamplingParams

        engine, t0 = self.engine, time.perf_counter()
        for m, req in self.requests.items():
            engine.add_request(f"{m}-{i}", self.prompt, SamplingParams(**req.params.model_dump()))
        first: dict[str, float] = {}
        done: dict[str, tuple[float, int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                mode, now = out.request_id.split("-")[0], time.perf_counter()
                tokens = len(out.outputs[0].token_ids) if out.outputs else 0
                if tokens and mode not in first:
                    first[mode] = now
                if out.finished:
                    done[mode] = (now, tokens)
        modes = {m: {"tokens": n, "ttft_ms": (first[m] - t0) * 1e3,
                     "tpot_ms": (end - first[m]) * 1e3 / (n - 1) if n > 1 else None}
                 for m, (end, n) in done.items()}
        return {"wall_s": time.perf_counter() - t0, "modes": modes}


def same_window_ratios(runs: dict[str, list[dict]], base: str = "inprocess") -> dict[str, dict[str, float]]:
    """Per path other than `base` and per mode, the median over runs of the path's TPOT over `base`'s in the same
    round (run i against run i: the paths take turns, so a pair shares the machine's window; this VM's speed
    drifts by up to ~25% over minutes, more than what a path adds)."""
    if base not in runs:
        return {}
    out: dict[str, dict[str, float]] = {}
    for path, got in runs.items():
        if path == base:
            continue
        ratios = {}
        for m in MODES:
            pairs = [(a["modes"].get(m, {}).get("tpot_ms"), b["modes"].get(m, {}).get("tpot_ms"))
                     for a, b in zip(got, runs[base])]
            pairs = [x / y for x, y in pairs if x and y]
            if pairs:
                ratios[m] = median(pairs)
        out[f"{path}/{base}"] = ratios
    return out


# ---- 4. where a step's time goes
def _breakdown(args, requests: dict) -> dict:
    from engine_service.bench.step_profile import step_breakdown
    from engine_service.engine.flags import engine_config_from_args
    from engine_service.engine.llm_engine import LLMEngine
    from engine_service.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    prompt = engine.tokenizer.apply_chat_template([m.model_dump() for m in requests["greedy"].messages],
                                                  tokenize=False, add_generation_prompt=True)
    params = {m: SamplingParams(**req.params.model_dump()) for m, req in requests.items()}
    step_breakdown(engine, [("warm-up", prompt, params["greedy"])], steps=4)
    return {"batch1": step_breakdown(engine, [("greedy", prompt, params["greedy"])]),
            "four_modes": step_breakdown(engine, [(m, prompt, p) for m, p in params.items()])}


def run(args: argparse.Namespace) -> int:
    import torch

    from engine_service.server.play import apply_play_defaults

    apply_play_defaults(args)  # what play runs unless told otherwise: int8 weights and one core left on a CPU
    requests = _requests(args)
    paths = args.paths.split(",")
    results = {"benchmark": "playground", "model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens,
               "repeats": args.repeats, "cpu": cpu_info(), "threads": args.threads or torch.get_num_threads(),
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
               "quantization": getattr(args, "quantization", None), "pipeline": args.pipeline, "paths": {}}
    # the paths take turns, run by run (browser, api, in-process, then again), so that each round's figures share
    # the machine's window and same_window_ratios can compare them
    runs: dict[str, list[dict]] = {}
    with contextlib.ExitStack() as on_exit:
        runners = {}
        if "browser" in paths or "api" in paths:
            stack, engine_url, web_url = _stack(args)
            on_exit.callback(stack.stop)
            if "browser" in paths:
                pids = {name: [proc.pid] for name, proc in stack.procs}
                runners["browser"] = on_exit.enter_context(_Browser(args, web_url, pids)).run
            if "api" in paths:
                runners["api"] = lambda i: _in_thread(lambda: asyncio.run(_api_once(engine_url, requests)))
        if "inprocess" in paths:
            runners["inprocess"] = _InProcess(args, requests).run
        for i in range(args.repeats + 1):  # the first round warms every path up and is not counted
            for name, one in runners.items():
                got = one(i)
                if i:
                    runs.setdefault(name, []).append(got)
        del runners  # the in-process engine: the breakdown loads its own
    for name, got in runs.items():
        results["paths"][name] = _summary(got)
    results["same_window"] = same_window_ratios(runs)
    if "breakdown" in paths:
        results["breakdown"] = _breakdown(args, requests)
        for name, b in results["breakdown"].items():
            print(f"{name:>10}: step {b['step_ms']:.1f} ms, {b['rows_per_step']:.1f} rows: " + ", ".join(
                f"{k.removesuffix('_ms')} {v:.1f}" for k, v in b.items() if k.endswith("_ms") and k != "step_ms"))
    path = write_results("playground-pipeline" if args.pipeline else "playground", results, args.out)
    _plot(results, path.with_suffix(".png"))
    for name, res in results["paths"].items():
        print(f"{name:>10}: wall {res['wall_s']:.2f} s  " + "  ".join(
            f"{m} TTFT {v['ttft_ms']:.0f} / TPOT {v['tpot_ms']:.0f} ms" for m, v in res["modes"].items()))
        if "cpu_s" in res:
            print(f"{'':>10}  CPU s per run: " + ", ".join(f"{k} {v:.2f}" for k, v in res["cpu_s"].items())
                  + f"; web {res['web_cpu_ms_per_token']:.1f} ms per token on screen")
    for pair, ratios in results["same_window"].items():
        print(f"TPOT {pair}, same rounds (median of the pairs): "
              + "  ".join(f"{m} {r:.2f}x" for m, r in ratios.items()))
    print(f"wrote {path} ({results['cpu']['label']})")
    return 0


def _plot(results: dict, path) -> None:
    plt = pyplot()

    paths = list(results["paths"])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(1, len(paths))
    for i, name in enumerate(paths):
        vals = [results["paths"][name]["modes"][m]["tpot_ms"] for m in MODES]
        ax.bar([x + i * width for x in range(len(MODES))], vals, width, label=name)
    ax.axhline(40, color="k", ls="--", lw=0.8, label="goal 40 ms (issue 25)")
    ax.set_xticks([x + width * (len(paths) - 1) / 2 for x in range(len(MODES))], MODES)
    ax.set_ylabel("TPOT, median (ms)")
    ax.legend()
    ax2.bar(paths, [results["paths"][n]["wall_s"] for n in paths], color="tab:gray")
    ax2.axhline(5, color="k", ls="--", lw=0.8)
    ax2.set_ylabel(f"{results['max_tokens']}-token run, wall (s)")
    fig.suptitle(f"playground four-mode run, {results['model']}, {results['cpu']['label']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
