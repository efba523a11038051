"""`decodelab bench route`: the service at cluster shape on one box, real processes throughout (Redis, replicas,
the API front), through the OpenAI API as clients come.

1. Multi-turn chats: conversations of several turns, each with its own long system prompt, a few conversations at a
   time, each turn carrying the replies so far. Against one replica, against N replicas on the shared stream (routing
   off) and N replicas with prefix-aware routing: the prefix-cache hit rate summed over the replicas' /metrics and the
   TTFT percentiles seen by the clients.
2. A hot prefix: every request shares one system prompt. How the routed requests spread over the replicas.
3. The routing decision's cost (tokenise, one Redis round trip, score), timed in this process against the live
   replicas of (1), and as the front's own histogram saw it.
4. The front in its own process against the replica's API in the engine's process and the engine in-process, at C
   concurrent streams (goodput, TTFT); then a burst of thousands of streams through the front (errors).
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from contextlib import contextmanager

from engine_service.bench.common import cpu_info, percentiles_ms, pyplot, write_with_plot

WORDS = ("river", "lantern", "copper", "meadow", "quiet", "signal", "harbor", "violet", "engine", "window", "paper",
         "silver", "garden", "thunder", "marble", "orbit", "candle", "forest", "ember", "glacier", "pocket", "canyon")
QUESTIONS = ("What should I do first?", "Can you say more?", "Give me an example.", "Summarise that in one line.",
             "Why does that matter?", "What is the next step?")


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("route", help="multi-replica routing: prefix hits, TTFT, hot prefixes, the API front")
    add_engine_args(p)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=6, help="conversations (and hot-prefix requests) at a time")
    p.add_argument("--system-words", type=int, default=150, help="words of each system prompt (~200 tokens)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--hot-requests", type=int, default=30)
    p.add_argument("--streams", type=int, default=64, help="concurrent streams: front vs replica API vs in-process")
    p.add_argument("--stream-prompt-len", type=int, default=12, help="words of each stream's prompt (~16 tokens)")
    p.add_argument("--stream-max-tokens", type=int, default=8)
    p.add_argument("--burst", type=int, default=2000, help="concurrent streams through the front (errors); 0: skip")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: chats, hot, streams")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


# ---- processes
class Cluster:
    """A private Redis, N replicas and one API front, as compose starts them (`service_env`: no UI on the cores)."""

    def __init__(self, args, n: int, routing: bool, redis_url: str, prefix: str):
        from engine_service.server.play import Stack, engine_argv, service_env
        from engine_service.server.redis_server import free_port

        self.stack, self.replica_urls, self.prefix = Stack(), [], prefix
        env = dict(service_env(redis_url), DECODELAB_REDIS_PREFIX=prefix, DECODELAB_MAX_PER_CLIENT="0",
                   DECODELAB_ROUTING="1" if routing else "0")
        for i in range(n):
            port = free_port()
            self.stack.spawn(f"engine{i}", [sys.executable, "-m", "engine_service.cli", "engine", *engine_argv(args),
                                            "--port", str(port), "--served-model-name", args.model,
                                            "--replica-name", f"r{i}", "--max-queue", "100000",
                                            "--log-level", "warning"], env)
            self.replica_urls.append(f"http://127.0.0.1:{port}")
        port = free_port()
        self.stack.spawn("api", [sys.executable, "-m", "engine_service.cli", "api", "--port", str(port),
                                 "--served-model-name", args.model, "--max-queue", "100000", "--log-level", "warning"],
                         env)
        self.api_url = f"http://127.0.0.1:{port}"

    def wait(self) -> Cluster:
        from engine_service.server.play import wait_ready

        for url in [*self.replica_urls, self.api_url]:
            wait_ready(f"{url}/ready", self.stack, 600, threading.Event())
        return self

    def counters(self) -> list[dict[str, float]]:
        """Per replica: prefix-cache queries and hits, finished requests (summed over outcomes)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        out = []
        for url in self.replica_urls:
            sums: dict[str, float] = {}
            for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
                for s in family.samples:
                    sums[s.name] = sums.get(s.name, 0.0) + s.value
            out.append({"prefix_queries": sums.get("decodelab_prefix_cache_queries_total", 0.0),
                        "prefix_hits": sums.get("decodelab_prefix_cache_hits_total", 0.0),
                        "requests": sums.get("decodelab_requests_total", 0.0)})
        return out


@contextmanager
def cluster(args, n: int, routing: bool, redis_url: str):
    c = Cluster(args, n, routing, redis_url, f"bench-route-{time.time_ns()}")
    try:
        yield c.wait()
    finally:
        c.stack.stop()


# ---- workloads
def system_prompt(rng: random.Random, words: int) -> str:
    return "You are a helpful assistant. Context: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


async def chat_turn(http, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """One streaming chat completion: (TTFT seconds, the reply)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0, ttft, text = time.perf_counter(), None, []
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk["choices"]:
                if (delta := choice.get("delta", {}).get("content")):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(delta)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(text)


async def multi_turn(api_url: str, model: str, systems: list[str], turns: int, concurrency: int,
                     max_tokens: int) -> dict:
    import httpx

    ttfts: list[float] = []
    prompts: list[list[dict]] = []
    queue: asyncio.Queue = asyncio.Queue()
    for i, system in enumerate(systems):
        queue.put_nowait((i, system))

    async with httpx.AsyncClient(base_url=api_url, timeout=600) as http:
        async def worker() -> None:
            while not queue.empty():
                i, system = queue.get_nowait()
                messages = [{"role": "system", "content": system}]
                for t in range(turns):
                    messages.append({"role": "user", "content": QUESTIONS[(i + t) % len(QUESTIONS)]})
                    prompts.append(list(messages))
                    ttft, reply = await chat_turn(http, model, messages, max_tokens)
                    ttfts.append(ttft)
                    messages.append({"role": "assistant", "content": reply})

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"requests": len(ttfts), "wall_s": wall, "ttft": percentiles_ms(ttfts), "prompts": prompts}


async def hot_prefix(api_url: str, model: str, system: str, n: int, concurrency: int, max_tokens: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=api_url, timeout=600) as http:
        async def one(i: int) -> float:
            async with sem:
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"}]
                return (await chat_turn(http, model, messages, max_tokens))[0]

        ttfts = await asyncio.gather(*(one(i) for i in range(n)))
    return {"requests": n, "ttft": percentiles_ms(list(ttfts))}


async def time_router(redis_url: str, prefix: str, model: str, prompts: list[list[dict]], repeats: int = 5) -> dict:
    """The routing decision as the front makes it (tokenise, one Redis round trip, score), per request."""
    from shared.client import connect
    from shared.keys import Keys
    from shared.protocol import ChatMessage, GenerationRequest
    from shared.router import Router

    r = connect(redis_url)
    router = Router(r, Keys(prefix))
    while router.tokenizer(model) is None:
        await asyncio.sleep(0.05)
    requests = [GenerationRequest(messages=[ChatMessage(**m) for m in p], model=model) for p in prompts]
    seconds, reasons = [], {}
    for _ in range(repeats):
        for req in requests:
            route = await router.route(req)
            seconds.append(route.seconds)
            reasons[route.reason] = reasons.get(route.reason, 0) + 1
    await r.aclose()
    return {"decisions": len(seconds), "seconds": percentiles_ms(seconds), "reasons": reasons}


def hit_rate(counters: list[dict]) -> float:
    queries = sum(c["prefix_queries"] for c in counters)
    return sum(c["prefix_hits"] for c in counters) / queries if queries else 0.0


# ---- the run
def run(args) -> int:
    from engine_service.server.play import apply_play_defaults
    from engine_service.server.redis_server import RedisServer

    apply_play_defaults(args)  # int8 on a CPU, as play and the Space run
    args.threads = 1  # N replicas share the cores: one thread each, the single replica too (same per-replica speed)
    skip = set(filter(None, args.skip.split(",")))
    rng = random.Random(0)
    server = RedisServer().start()
    results: dict = {"cpu": cpu_info(), "model": args.model, "quantization": args.quantization,
                     "threads_per_replica": args.threads, "replicas": args.replicas, "started": time.time()}
    try:
        if "chats" not in skip:
            systems = [system_prompt(rng, args.system_words) for _ in range(args.conversations)]
            chats = {}
            for name, n, routing in (("one", 1, True), ("shared", args.replicas, False),
                                     ("routed", args.replicas, True)):
                with cluster(args, n, routing, server.url) as c:
                    run_ = asyncio.run(multi_turn(c.api_url, args.model, systems, args.turns, args.concurrency,
                                                  args.max_tokens))
                    prompts = run_.pop("prompts")
                    counters = c.counters()
                    run_.update(replicas=counters, hit_rate=hit_rate(counters))
                    if name == "routed":
                        run_["router"] = asyncio.run(time_router(server.url, c.prefix, args.model, prompts))
                        run_["front_route_histogram"] = _front_histogram(c.api_url)
                    chats[name] = run_
                    print(f"chats, {name}: hit rate {run_['hit_rate']:.3f}, TTFT p50 {run_['ttft']['p50_ms']:.0f} ms "
                          f"p90 {run_['ttft']['p90_ms']:.0f} ms, {run_['wall_s']:.1f} s", flush=True)
            chats["hit_rate_vs_one"] = chats["routed"]["hit_rate"] / max(1e-9, chats["one"]["hit_rate"])
            chats["ttft_p50_shared_over_routed"] = chats["shared"]["ttft"]["p50_ms"] / chats["routed"]["ttft"]["p50_ms"]
            results["chats"] = chats
        if "hot" not in skip:
            with cluster(args, args.replicas, True, server.url) as c:
                hot = asyncio.run(hot_prefix(c.api_url, args.model, system_prompt(rng, args.system_words),
                                             args.hot_requests, args.concurrency, args.max_tokens))
                counters = c.counters()
                hot.update(replicas=counters, share=[x["requests"] / max(1, args.hot_requests) for x in counters],
                           hit_rate=hit_rate(counters))
            print(f"hot prefix: shares {[round(s, 2) for s in hot['share']]}, hit rate {hot['hit_rate']:.3f}",
                  flush=True)
            results["hot_prefix"] = hot
        if "streams" not in skip:
            results["streams"] = streams(args, server.url, rng)
    finally:
        server.close()
    results["finished"] = time.time()
    write_with_plot("route", results, args.out, plot)
    return 0


def _front_histogram(api_url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    buckets = {}
    for family in text_string_to_metric_families(httpx.get(f"{api_url}/metrics", timeout=10).text):
        if family.name == "decodelab_route_seconds":
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    buckets[s.labels["le"]] = s.value
                elif s.name.endswith(("_count", "_sum")):
                    buckets[s.name.rsplit("_", 1)[1]] = s.value
    return buckets


def streams(args, redis_url: str, rng: random.Random) -> dict:
    """C concurrent streams: through the front, through the replica's own API, and the engine in this process."""
    from engine_service.bench.sweep import http_burst, inprocess_burst
    from engine_service.engine.flags import engine_config_from_args
    from engine_service.engine.llm_engine import LLMEngine

    out: dict = {"concurrency": args.streams}
    with cluster(args, 1, True, redis_url) as c:
        def fresh(n: int, words: int = args.stream_prompt_len) -> list[str]:
            """New prompts for each burst: a unique number first, so none hits the prefix cache."""
            return [f"{rng.randrange(10 ** 9)} " + " ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]

        asyncio.run(http_burst(c.api_url, args.model, fresh(2), 4))  # warm-up
        for name, url in (("front", c.api_url), ("replica_api", c.replica_urls[0]),
                          ("front_again", c.api_url), ("replica_api_again", c.replica_urls[0])):
            out[name] = asyncio.run(http_burst(url, args.model, fresh(args.streams), args.stream_max_tokens))
            print(f"{args.streams} streams via {name}: goodput {out[name]['goodput_tok_per_s']:.1f} tok/s, TTFT p50 "
                  f"{out[name]['ttft'].get('p50_ms', float('nan')):.0f} ms, errors {out[name]['errors']}", flush=True)
        if args.burst:
            out["burst"] = asyncio.run(http_burst(c.api_url, args.model, fresh(args.burst, 8), 3))
            out["burst"].pop("itl", None)
            print(f"{args.burst} streams via the front: {out['burst']['ok']} ok, errors {out['burst']['errors']}",
                  flush=True)
    engine = LLMEngine(engine_config_from_args(args))  # after the cluster: nothing else runs beside it
    inprocess_burst(engine, fresh(2), 4)
    out["inprocess"] = inprocess_burst(engine, fresh(args.streams), args.stream_max_tokens)
    best = lambda k: max(out[k]["goodput_tok_per_s"], out[k + "_again"]["goodput_tok_per_s"])  # noqa: E731
    out["front_goodput_vs_inprocess"] = best("front") / out["inprocess"]["goodput_tok_per_s"]
    out["replica_api_goodput_vs_inprocess"] = best("replica_api") / out["inprocess"]["goodput_tok_per_s"]
    out["front_ttft_p50_overhead_ms"] = (min(out["front"]["ttft"]["p50_ms"], out["front_again"]["ttft"]["p50_ms"])
                                         - out["inprocess"]["ttft"]["p50_ms"])
    print(f"in-process: goodput {out['inprocess']['goodput_tok_per_s']:.1f} tok/s, TTFT p50 "
          f"{out['inprocess']['ttft']['p50_ms']:.0f} ms; front/in-process goodput "
          f"{out['front_goodput_vs_inprocess']:.3f}, TTFT p50 overhead {out['front_ttft_p50_overhead_ms']:.0f} ms",
          flush=True)
    return out


def plot(results: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    chats = results.get("chats")
    if chats:
        names = ["one", "shared", "routed"]
        axes[0].bar(names, [chats[n]["hit_rate"] for n in names], color=["#888", "#c66", "#4a4"])
        axes[0].set(ylabel="prefix-cache hit rate", title=f"multi-turn chats ({results['replicas']} replicas)")
        for q, off in (("p50_ms", -0.2), ("p90_ms", 0.2)):
            axes[1].bar([i + off for i in range(3)], [chats[n]["ttft"][q] for n in names], width=0.4, label=q[:3])
        axes[1].set_xticks(range(3), names)
        axes[1].set(ylabel="TTFT (ms)", title="multi-turn chats: TTFT")
        axes[1].legend()
    hot = results.get("hot_prefix")
    if hot:
        axes[2].bar([f"r{i}" for i in range(len(hot["share"]))], hot["share"])
        axes[2].axhline(0.2, color="#c66", ls="--", lw=1)
        axes[2].set(ylabel="share of requests", title="one hot prefix, routed")
    fig.suptitle(f"decodelab bench route: {results['model']} {results['quantization']}, one thread per replica; "
                 f"{results['cpu']['label']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
