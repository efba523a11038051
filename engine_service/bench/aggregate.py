"""`decodelab bench aggregate`: our service against llama.cpp's own server, both through the OpenAI API.

The anchor of issue 25: `llama-server -np 8` (8 parallel slots, continuous batching), built from the llama.cpp that
llama-cpp-python vendors with this CPU's GGML flags (bench/llamacpp_build.py), on the same GGUF file our engine
loads, with the same threads. Ours: a private Redis and one `decodelab engine` replica (int8 unless told; its own
OpenAI API, or `--via front` through `decodelab api`).

Per server, through the same client (`--client http`, the default: aiohttp reading the events itself, lean on the
cores it shares with the server; `--client openai`: the official package, ~4x its CPU a chunk): a warm-up; `--runs`
single streams (TPOT = (last text chunk - first) / (tokens - 1), the median over runs); then `--runs` bursts of
`--streams` concurrent streaming completions, greedy (temperature 0), `ignore_eos`, `--max-tokens` each, the same
prompts for both servers (fresh words every run: no prompt cache hit between runs). A burst's aggregate tok/s =
generated tokens / wall time (first request sent to last stream done); the JSON has every run, the best and the
median, and ours / llama-server's ratios. `ours.replica_steps` reads our replica's own step records back from Redis:
its median decode step with all streams in it during the bursts (to set beside the in-process step of `bench
throughput` / `step_profile`: what serving on the same cores costs), the steps' share of the bursts' wall time and
prefill's share of the steps; `ours.single_stream.replica_steps` the same for the single streams (its one-row step
beside `bench throughput`'s in-process single stream). Tokens are the server's `usage.completion_tokens`, else the
count of text chunks.

`--order interleaved` (the default): both servers up, idle between their turns, and each run of one taken right
after the same run of the other (the order flipping every run), so that each pair shares a minute of the machine:
a 2-core box drifts 1.5x within an hour, more than the ratio we look for. The JSON's `paired` ratios are the
medians of each pair's ratio. `--order sequential`: one server at a time, all its runs, then the other.

Both servers are stopped at the end and on any error (each runs in its own process group; `Stack.stop`).
Writes benchmarks/results/aggregate.json and aggregate.png.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from engine_service.bench import llamacpp, llamacpp_build
from engine_service.bench.common import cpu_info, median, pyplot, write_with_plot

WORDS = ("river", "lantern", "copper", "meadow", "quiet", "signal", "harbor", "violet", "engine", "window", "paper",
         "silver", "garden", "thunder", "marble", "orbit", "candle", "forest", "ember", "glacier", "pocket", "canyon")
GOALS = {"aggregate": 2.0, "single_stream": 1.2}  # issue 25: ours / llama.cpp


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("aggregate", help="ours vs llama.cpp's llama-server -np N, N streams through the "
                                               "OpenAI API (and single-stream TPOT)")
    add_engine_args(p)
    p.add_argument("--streams", type=int, default=8, help="concurrent streams (and llama-server's -np slots)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=24, help="words of each prompt (~30 tokens)")
    p.add_argument("--runs", type=int, default=3, help="bursts (and single streams) per server: best and median")
    p.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server's -c is this times --streams")
    p.add_argument("--via", default="replica", choices=["replica", "front"],
                   help="ours through the replica's own API (one process, as llama-server) or `decodelab api`")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: build this CPU's, cached)")
    p.add_argument("--skip", default="", help="comma-separated: llama, ours (e.g. to time one side)")
    p.add_argument("--order", default="interleaved", choices=["interleaved", "sequential"],
                   help="interleaved: both servers up, each run of one beside the same run of the other")
    p.add_argument("--client", default="http", choices=list(CLIENTS),
                   help="the load generator: http (aiohttp, lean on the shared cores) or openai (the official package)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


# ---- the maths, on what the clients saw
@dataclass
class StreamTrace:
    """One streaming completion: when it was sent, when each text chunk came, and how it ended."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    finish: str | None = None
    done: float = 0.0


def tpot_s(trace: StreamTrace) -> float:
    """Time per output token after the first, as our RequestOutput.metrics.tpot defines it."""
    assert trace.tokens > 1 and trace.chunks, "tpot: needs two tokens or more"
    return (trace.chunks[-1] - trace.chunks[0]) / (trace.tokens - 1)


def burst_summary(traces: list[StreamTrace]) -> dict:
    """One burst: generated tokens over the wall time from the first send to the last stream's end."""
    start, end = min(t.sent for t in traces), max(t.done for t in traces)
    tokens = sum(t.tokens for t in traces)
    return {"streams": len(traces), "tokens": tokens, "wall_s": end - start, "tok_per_s": tokens / (end - start),
            "finish": dict(Counter(t.finish for t in traces))}


def replica_steps(records: list, windows: list[tuple[float, float]], streams: int) -> dict | None:
    """What our replica's engine did during the bursts, from its own step records (shared.monitor.StepRecord, read
    back from Redis): the median decode step with every stream in it (against `bench throughput`'s or
    `step_profile`'s in-process step, the cost of serving beside the engine on the same cores), the share of the
    bursts' wall time spent in steps, and prefill's share of it. `windows`: each burst's (start, end), unix time."""
    inside = [r for r in records if any(a <= r.start and r.start + r.seconds <= b for a, b in windows)]
    full = [r.seconds for r in inside if r.prefill_tokens == 0 and r.num_seqs == streams]
    if not inside or not full:
        return None
    busy = sum(r.seconds for r in inside)
    return {"decode_step_ms": median(full) * 1e3, "decode_steps": len(full), "steps": len(inside),
            "busy_share": busy / sum(b - a for a, b in windows),
            "prefill_share": sum(r.seconds for r in inside if r.prefill_tokens) / busy}


def best_and_median(runs: list[dict], key: str = "tok_per_s") -> dict:
    values = [r[key] for r in runs]
    return {"best": max(values), "median": median(values), "runs": runs}


def ratios(ours: dict, theirs: dict) -> dict:
    """ours / llama-server's, for the aggregate (best and median of the bursts) and the single stream."""
    out = {"aggregate_best": ours["aggregate"]["best"] / theirs["aggregate"]["best"],
           "aggregate_median": ours["aggregate"]["median"] / theirs["aggregate"]["median"],
           "single_stream": ours["single_stream"]["tok_per_s"] / theirs["single_stream"]["tok_per_s"]}
    if ours.get("paired") and theirs.get("paired"):  # run i of one beside run i of the other
        pairs = zip(ours["aggregate"]["runs"], theirs["aggregate"]["runs"], strict=True)
        singles = zip(ours["single_stream"]["runs"], theirs["single_stream"]["runs"], strict=True)
        out["paired"] = {"aggregate_median": median([a["tok_per_s"] / b["tok_per_s"] for a, b in pairs]),
                         "single_stream_median": median([b["tpot_ms"] / a["tpot_ms"] for a, b in singles])}
    out["goals_met"] = {"aggregate": out["aggregate_best"] >= GOALS["aggregate"],
                        "single_stream": out["single_stream"] >= GOALS["single_stream"]}
    return out


# ---- the clients
def prompts_for(seed: int, n: int, words: int) -> list[str]:
    """`n` prompts of `words` words, the same for both servers at the same seed."""
    rng = random.Random(seed)
    return [f"Story {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def request_body(model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion of exactly `max_tokens` greedy tokens (ignore_eos), usage in the last chunk."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


class HttpClient:
    """The default load generator: aiohttp, reading the server-sent events itself, as vLLM's and SGLang's serving
    benchmarks do. The client runs on the cores the server computes on, so its CPU a chunk is taken from the server's
    steps: the `openai` package's models cost ~0.2 ms a chunk (at 8 streams 9.7% of a core against this one's 2.4%,
    session 36), which stretched our replica's 8-row step from 13.4 to 17 ms, and llama-server's ~30 ms ones less."""

    def __init__(self, base_url: str):
        self.url = f"{base_url}/v1/completions"
        self.session = None  # made in the event loop that streams (aiohttp asks for a running one)

    def _session(self):
        import aiohttp

        if self.session is None:  # a connection per request: a pooled keep-alive one the server has just closed
            self.session = aiohttp.ClientSession(  # fails mid-send (seen with llama-server)
                connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=900))
        return self.session

    async def stream(self, model: str, prompt: str, max_tokens: int) -> StreamTrace:
        trace, usage = StreamTrace(time.perf_counter()), None
        async with self._session().post(self.url, json=request_body(model, prompt, max_tokens)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.url}: HTTP {resp.status}: {(await resp.text())[:300]}")
            async for line in resp.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now, chunk = time.perf_counter(), json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"{self.url}: error mid-stream: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        trace.chunks.append(now)
                    trace.finish = choice.get("finish_reason") or trace.finish
        trace.done = time.perf_counter()
        trace.tokens = usage["completion_tokens"] if usage else len(trace.chunks)
        return trace

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


class OpenAIClient:
    """`--client openai`: the official package (every figure before session 36 came through it), the same request as
    `request_body` (what the package has no parameter for goes in `extra_body`)."""

    def __init__(self, base_url: str):
        from openai import AsyncOpenAI

        # retries: a pooled keep-alive connection the server has just closed fails before any byte comes back (seen
        # once with llama-server at the first burst); the client then sends the request again, nothing counted twice
        self.client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=900, max_retries=2)

    async def stream(self, model: str, prompt: str, max_tokens: int) -> StreamTrace:
        trace, usage = StreamTrace(time.perf_counter()), None
        stream = await self.client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.text:
                    trace.chunks.append(now)
                trace.finish = choice.finish_reason or trace.finish
        trace.done = time.perf_counter()
        trace.tokens = usage.completion_tokens if usage is not None else len(trace.chunks)
        return trace

    async def close(self) -> None:
        await self.client.close()


CLIENTS = {"http": HttpClient, "openai": OpenAIClient}


def run_order(labels: list[str], r: int) -> list[str]:
    """Who goes first in run r: flipped every run, so a drifting machine favours neither side."""
    return labels if r % 2 == 0 else labels[::-1]


async def measure(sides: dict[str, tuple[str, str]], args) -> dict[str, dict]:
    """label -> (base URL, model name): warm-ups, single streams, then bursts of `args.streams`, run by run, each
    run of every side in turn (the order flipping every run); prints as it goes."""
    clients = {label: CLIENTS[args.client](url) for label, (url, _) in sides.items()}
    singles: dict[str, list] = {label: [] for label in sides}
    bursts: dict[str, list] = {label: [] for label in sides}

    def turns(r: int) -> list[tuple[str, object, str]]:
        return [(label, clients[label], sides[label][1]) for label in run_order(list(sides), r)]

    try:
        for _, client, model in turns(0):  # warm-up
            await asyncio.gather(*(client.stream(model, p, 4) for p in prompts_for(-1, 2, 8)))
        for r in range(args.runs):
            for label, client, model in turns(r):
                start = time.time()
                trace = await client.stream(model, prompts_for(1000 + args.seed + r, 1, args.prompt_words)[0],
                                           args.max_tokens)
                singles[label].append({"tpot_ms": tpot_s(trace) * 1e3, "tokens": trace.tokens,
                                       "finish": trace.finish, "window": [start, time.time()]})
                print(f"{label}: single stream, run {r + 1}: TPOT {singles[label][-1]['tpot_ms']:.2f} ms", flush=True)
        for r in range(args.runs):
            prompts = prompts_for(args.seed + r, args.streams, args.prompt_words)
            for label, client, model in turns(r):
                start = time.time()
                b = burst_summary(list(await asyncio.gather(
                    *(client.stream(model, p, args.max_tokens) for p in prompts))))
                b["window"] = [start, time.time()]
                bursts[label].append(b)
                print(f"{label}: {args.streams} streams, run {r + 1}: {b['tok_per_s']:.1f} tok/s "
                      f"({b['tokens']} tokens in {b['wall_s']:.2f} s, finish {b['finish']})", flush=True)
    finally:
        for client in clients.values():
            await client.close()
    out = {}
    for label in sides:
        tpot = median([x["tpot_ms"] for x in singles[label]])
        print(f"{label}: single stream TPOT {tpot:.2f} ms ({1e3 / tpot:.1f} tok/s), median of {args.runs}", flush=True)
        out[label] = {"single_stream": {"tpot_ms": tpot, "tok_per_s": 1e3 / tpot, "runs": singles[label]},
                      "aggregate": best_and_median(bursts[label]), "paired": len(sides) > 1}
    return out


# ---- the servers
def llama_server_argv(binary: Path, gguf: Path, streams: int, ctx_per_slot: int, threads: int, port: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "-np", str(streams), "-c", str(streams * ctx_per_slot), "-t", str(threads),
            "-tb", str(threads), "--cont-batching", "--host", "127.0.0.1", "--port", str(port)]


@contextmanager
def llama_server(argv: list[str], url: str, log: Path):
    """llama-server in its own process group, its output in `log`; ready at `url`/health; stopped (TERM, then
    KILL) on the way out, also on an error. Yields its process."""
    from engine_service.server.play import Stack, wait_ready

    stack = Stack()
    with log.open("w") as out:
        proc = stack.spawn("llama-server", argv, dict(os.environ), stdout=out)
    try:
        wait_ready(f"{url}/health", stack, 300, threading.Event())
        yield proc
    finally:
        stack.stop()


def system_info(lib_dir: Path) -> str | None:
    """llama.cpp's own line of the CPU features its build runs with (llama_print_system_info of the libllama.so
    beside llama-server; llama-server logs it only at trace verbosity). In a child: a build for another ISA may
    SIGILL."""
    import subprocess

    code = ("import ctypes, sys; f = ctypes.CDLL(sys.argv[1]).llama_print_system_info; f.restype = ctypes.c_char_p; "
            "print(f().decode())")
    proc = subprocess.run([sys.executable, "-c", code, str(lib_dir / "libllama.so")], capture_output=True, text=True,
                          timeout=60)
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


@dataclass
class OurServer:
    url: str  # the OpenAI API's base URL
    redis_url: str
    prefix: str  # the replicas' key prefix (shared.keys.Keys)

    def step_records(self) -> list:
        """Every step record our replicas keep in Redis (up to shared.monitor.STEPS_MAXLEN each)."""
        from redis import asyncio as aioredis

        from shared.keys import Keys
        from shared.monitor import STEPS_MAXLEN, steps

        async def read() -> list:
            r = aioredis.Redis.from_url(self.redis_url, decode_responses=True)
            try:
                keys = Keys(self.prefix)
                out = []
                async for key in r.scan_iter(match=keys.steps("*")):  # every replica's, heartbeat or not
                    out += (await steps(r, keys, key.removeprefix(keys.steps("")), count=2 * STEPS_MAXLEN))[0]
                return out
            finally:
                await r.aclose()

        return asyncio.run(read())


@contextmanager
def our_server(args):
    """A private Redis and one replica (its API, or the front's)."""
    from engine_service.server.redis_server import RedisServer

    redis = RedisServer().start()
    try:
        if args.via == "front":
            from engine_service.bench.route import cluster

            with cluster(args, 1, False, redis.url) as c:
                yield OurServer(c.api_url, redis.url, c.prefix)
        else:
            from engine_service.bench.serve import start_replica

            prefix = f"bench-aggregate-{time.time_ns()}"
            stack, url = start_replica(args, redis.url, prefix)
            try:
                yield OurServer(url, redis.url, prefix)
            finally:
                stack.stop()
    finally:
        redis.close()


def run(args) -> int:
    gguf = llamacpp.gguf_file(args.model)
    if isinstance(gguf, str):
        raise ValueError(gguf)
    args.threads = args.threads or len(os.sched_getaffinity(0))
    args.quantization = args.quantization or "int8"
    skip = set(filter(None, args.skip.split(",")))
    build = llamacpp_build.for_this_cpu()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"benchmark": "aggregate", "model": args.model, "gguf": str(gguf), "threads": args.threads,
           "streams": args.streams, "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
           "runs": args.runs, "client": args.client, "cpu": cpu_info()}
    with ExitStack() as servers:
        sides: dict[str, tuple[str, str]] = {}
        if "llama" not in skip:
            binary = Path(args.llama_server) if args.llama_server else llamacpp_build.build_server(build)
            from engine_service.server.redis_server import free_port

            port = free_port()
            argv = llama_server_argv(binary, gguf, args.streams, args.ctx_per_slot, args.threads, port)
            url = f"http://127.0.0.1:{port}"
            servers.enter_context(llama_server(argv, url, out_dir / "aggregate_llama_server.log"))
            sides["llama-server"] = (url, "gguf")
            if args.order == "sequential":
                res["llama_server"] = asyncio.run(measure(sides, args))["llama-server"]
                servers.close()
                sides = {}
        ours = None
        if "ours" not in skip:
            ours = servers.enter_context(our_server(args))
            sides["ours"] = (ours.url, args.model)
        measured = asyncio.run(measure(sides, args)) if sides else {}
        if ours is not None:
            records = ours.step_records()
            windows = [tuple(b["window"]) for b in measured["ours"]["aggregate"]["runs"]]
            measured["ours"]["replica_steps"] = replica_steps(records, windows, args.streams)
            windows = [tuple(s["window"]) for s in measured["ours"]["single_stream"]["runs"]]
            measured["ours"]["single_stream"]["replica_steps"] = replica_steps(records, windows, 1)
    if "llama-server" in measured:
        res["llama_server"] = measured["llama-server"]
    if "llama_server" in res:
        res["llama_server"].update(argv=argv, system_info=system_info(binary.parent),
                                   build=build.describe() if not args.llama_server else {"binary": str(binary)})
    if "ours" in measured:
        res["ours"] = measured["ours"]
        res["ours"].update(quantization=args.quantization, via=args.via)
        if res["ours"].get("replica_steps"):
            st = res["ours"]["replica_steps"]
            print(f"ours, in the replica during the bursts: a {args.streams}-stream decode step "
                  f"{st['decode_step_ms']:.2f} ms (median of {st['decode_steps']}), steps {st['busy_share']:.0%} of "
                  f"the wall, prefill {st['prefill_share']:.0%} of the steps", flush=True)
        if res["ours"]["single_stream"].get("replica_steps"):
            st = res["ours"]["single_stream"]["replica_steps"]
            print(f"ours, in the replica during the single streams: a decode step {st['decode_step_ms']:.2f} ms "
                  f"(median of {st['decode_steps']}), steps {st['busy_share']:.0%} of the wall", flush=True)
    res["order"] = args.order
    if "llama_server" in res and "ours" in res:
        res["ratios"] = ratios(res["ours"], res["llama_server"])
        r = res["ratios"]
        print(f"ours / llama-server: aggregate {r['aggregate_best']:.2f}x (best; median {r['aggregate_median']:.2f}x, "
              f"goal >= {GOALS['aggregate']}x), single stream {r['single_stream']:.2f}x "
              f"(goal >= {GOALS['single_stream']}x)", flush=True)
        if "paired" in r:
            print(f"  run by run (median of each pair's ratio): aggregate {r['paired']['aggregate_median']:.2f}x, "
                  f"single stream {r['paired']['single_stream_median']:.2f}x", flush=True)
    write_with_plot("aggregate", res, out_dir, plot)
    return 0


def plot(res: dict, path) -> None:
    plt = pyplot()

    sides = [(name, res[key]) for name, key in (("llama-server", "llama_server"), ("ours", "ours")) if key in res]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [n for n, _ in sides]
    axes[0].bar(names, [s["aggregate"]["best"] for _, s in sides], color=["tab:gray", "tab:blue"][:len(sides)])
    axes[0].scatter([n for n, s in sides for _ in s["aggregate"]["runs"]],
                    [r["tok_per_s"] for _, s in sides for r in s["aggregate"]["runs"]], color="k", s=12, zorder=3,
                    label="each run")
    axes[0].set(title=f"{res['streams']} concurrent streams (best of {res['runs']})", ylabel="generated tok/s")
    axes[0].legend(fontsize=8)
    axes[1].bar(names, [s["single_stream"]["tok_per_s"] for _, s in sides], color=["tab:gray", "tab:blue"][:len(sides)])
    axes[1].set(title="single stream (1 / median TPOT)", ylabel="tok/s")
    flags = " ".join(f.removeprefix("-DGGML_") for f in res.get("llama_server", {}).get("build", {})
                     .get("cmake_flags", []))
    ratio = res.get("ratios")
    fig.suptitle(f"{Path(res['gguf']).name}, {res['threads']} threads, {res['max_tokens']} tokens/stream, "
                 f"{res.get('client', 'openai')} client; {res['cpu']['label']}\nllama.cpp flags: {flags or 'n/a'}"
                 + (f"; ours/llama-server {ratio['aggregate_best']:.2f}x aggregate, {ratio['single_stream']:.2f}x "
                    "single" if ratio else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
