"""`decodelab bench pd`: prefill/decode disaggregation against colocation, on the same cores, real processes.

1. Interference: decoding streams (short prompts, long outputs) run while long prompts keep arriving. Colocated
   (two `both` replicas) against disaggregated (one `prefill`, one `decode`), one thread each: the decoding
   streams' inter-token latency (p50 / p99), the long prompts' TTFT, goodput under a TTFT + TPOT SLO, and the
   hand-over's cost per request and per MB of KV (from the DoneEvents' `handover` metrics).
2. Faults: requests through a prefill + decode pair while a replica is killed (-9) every `--kill-every` requests and
   started again (alternately the prefill and the decode replica): every request must end exactly once, and no
   transfer key or queue entry may be left behind.
"""
from __future__ import annotations

import asyncio
import random
import signal
import sys
import threading
import time
from collections import Counter

from engine_service.bench.common import cpu_info, median, percentiles_ms, pyplot, write_with_plot
from engine_service.bench.route import WORDS


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("pd", help="prefill/decode disaggregation vs colocation: ITL, TTFT, transfer cost")
    add_engine_args(p)
    p.add_argument("--streams", type=int, default=6, help="decoding streams running throughout")
    p.add_argument("--stream-tokens", type=int, default=160)
    p.add_argument("--long-words", type=int, default=900, help="words of each long prompt (~1,200 tokens)")
    p.add_argument("--long-every", type=float, default=1.5, help="seconds between long prompts")
    p.add_argument("--long-count", type=int, default=8)
    p.add_argument("--slo-ttft", type=float, default=3.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    p.add_argument("--fault-requests", type=int, default=1000, help="0: skip the fault run")
    p.add_argument("--kill-every", type=int, default=100)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


class Replicas:
    """`decodelab engine` processes on one Redis prefix, each restartable."""

    def __init__(self, args, redis_url: str, prefix: str):
        from engine_service.server.play import Stack, service_env

        self.args, self.stack = args, Stack()
        self.env = dict(service_env(redis_url), DECODELAB_REDIS_PREFIX=prefix)
        self.urls: dict[str, str] = {}

    def start(self, name: str, role: str) -> None:
        from engine_service.server.play import engine_argv
        from engine_service.server.redis_server import free_port

        port = free_port()
        self.stack.spawn(name, [sys.executable, "-m", "engine_service.cli", "engine", *engine_argv(self.args),
                                "--port", str(port), "--served-model-name", self.args.model, "--replica-name", name,
                                "--role", role, "--claim-idle", "2", "--max-queue", "100000",
                                "--log-level", "warning"], self.env)
        self.urls[name] = f"http://127.0.0.1:{port}"

    def wait(self) -> None:
        from engine_service.server.play import wait_ready

        for url in self.urls.values():
            wait_ready(f"{url}/ready", self.stack, 600, threading.Event())

    def kill(self, name: str) -> None:
        import os

        for n, proc in self.stack.procs:
            if n == name and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.stack.procs = [(n, p) for n, p in self.stack.procs if n != name]


def words(rng: random.Random, n: int) -> str:
    return f"{rng.randrange(10 ** 9)} " + " ".join(rng.choice(WORDS) for _ in range(n))


async def interference(redis_url: str, prefix: str, args, rng: random.Random) -> dict:
    from shared.client import EngineClient, connect
    from shared.keys import Keys
    from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions, TokenEvent

    client = EngineClient(connect(redis_url), Keys(prefix), max_per_client=0)
    itl: list[float] = []
    long_runs: list[dict] = []
    stream_runs: list[dict] = []

    async def one(prompt: str, max_tokens: int, into: list) -> None:
        sub = await client.submit(GenerationRequest(prompt=prompt, params=SamplingOptions(
            max_tokens=max_tokens, temperature=0, ignore_eos=True)))
        t0, times, done = time.perf_counter(), [], None
        async for ev in client.stream(sub, 600):
            if isinstance(ev, TokenEvent):
                times += [time.perf_counter()] * max(1, len(ev.token_ids))
            else:
                done = ev
        ok = isinstance(done, DoneEvent)
        run = {"ok": ok, "ttft": times[0] - t0 if times else None,
               "tpot": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
               "gaps": [b - a for a, b in zip(times, times[1:]) if b > a],
               "handover": done.metrics.handover if ok else None}
        into.append(run)

    async def long_prompts() -> None:
        tasks = []
        for _ in range(args.long_count):
            tasks.append(asyncio.create_task(one(words(rng, args.long_words), 16, long_runs)))
            await asyncio.sleep(args.long_every)
        await asyncio.gather(*tasks)

    start = time.perf_counter()
    streams = [asyncio.create_task(one(words(rng, 12), args.stream_tokens, stream_runs))
               for _ in range(args.streams)]
    await asyncio.sleep(0.5)  # the streams are decoding when the first long prompt comes
    await long_prompts()
    await asyncio.gather(*streams)
    wall = time.perf_counter() - start
    await client.close()
    itl = [g for r in stream_runs for g in r["gaps"]]
    every = stream_runs + long_runs
    good = [r for r in every if r["ok"] and r["ttft"] is not None and r["ttft"] <= args.slo_ttft
            and (r["tpot"] is None or r["tpot"] <= args.slo_tpot)]
    handovers = [r["handover"] for r in every if r["handover"]]
    return {"wall_s": wall, "ok": sum(r["ok"] for r in every), "requests": len(every),
            "stream_itl": percentiles_ms(itl), "stream_tpot": percentiles_ms([r["tpot"] for r in stream_runs
                                                                             if r["tpot"]]),
            "long_ttft": percentiles_ms([r["ttft"] for r in long_runs if r["ttft"] is not None]),
            "goodput_req_per_s": len(good) / wall, "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
            "handover": _handover_costs(handovers)}


def _handover_costs(handovers: list[dict]) -> dict:
    if not handovers:
        return {}
    ms = [h.get("transfer_ms", 0.0) for h in handovers if "transfer_ms" in h]
    mb = [h["bytes"] / 1e6 for h in handovers if h.get("bytes")]
    per_mb = [h["transfer_ms"] / (h["bytes"] / 1e6) for h in handovers if h.get("bytes") and "transfer_ms" in h]
    return {"count": len(handovers), "transfer_ms": percentiles_ms([x / 1e3 for x in ms]) if ms else {},
            "mb_per_request_median": median(mb) if mb else 0.0,
            "ms_per_mb_median": median(per_mb) if per_mb else None,
            "imported_tokens_median": median([h.get("imported_tokens", 0) for h in handovers])}


async def faults(redis_url: str, prefix: str, reps: Replicas, args, rng: random.Random) -> dict:
    """`fault_requests` requests, a few at a time, a replica killed -9 and restarted every `kill_every`."""
    import redis as sync_redis

    from shared.client import EngineClient, connect
    from shared.keys import Keys
    from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions

    keys = Keys(prefix)
    client = EngineClient(connect(redis_url), keys, max_per_client=0, recover_after=1.0)
    outcomes: Counter = Counter()
    kills, sem, done_count = 0, asyncio.Semaphore(8), 0

    async def one(i: int) -> None:
        nonlocal done_count, kills
        async with sem:
            ev = await client.generate(GenerationRequest(prompt=words(rng, 40), params=SamplingOptions(
                max_tokens=8, temperature=0, ignore_eos=True)), timeout=300)
            outcomes["done" if isinstance(ev, DoneEvent) else ev.code] += 1
            done_count += 1
            if done_count % args.kill_every == 0 and done_count < args.fault_requests:
                name = "prefill" if kills % 2 == 0 else "decode"
                reps.kill(name)
                kills += 1
                reps.start(name, name)  # a fresh process under the same name; the dead one's entries are claimed

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.fault_requests)))
    wall = time.perf_counter() - start
    await client.close()
    r = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    settle_s = 2.0  # the last hand-overs' keys are taken within this
    time.sleep(settle_s)
    left = {"transfer_keys": len(r.keys(keys.kv_transfer("*"))),
            "queued_or_pending": sum(r.xlen(s) for s in r.smembers(keys.streams))}
    r.close()
    return {"requests": args.fault_requests, "kills": kills, "outcomes": dict(outcomes), "wall_s": wall,
            "left_behind": left, "settle_s": settle_s}


def run(args) -> int:
    from engine_service.server.play import apply_play_defaults
    from engine_service.server.redis_server import RedisServer

    apply_play_defaults(args)
    args.threads = 1  # two replicas on the two cores, one thread each, in both configurations
    rng = random.Random(0)
    server = RedisServer().start()
    results: dict = {"cpu": cpu_info(), "model": args.model, "quantization": args.quantization,
                     "threads_per_replica": 1, "started": time.time()}
    try:
        for name, roles in (("colocated", ("both", "both")), ("disaggregated", ("prefill", "decode"))):
            prefix = f"bench-pd-{name}-{time.time_ns()}"
            reps = Replicas(args, server.url, prefix)
            for i, role in enumerate(roles):
                reps.start(f"{role}{i}", role)
            try:
                reps.wait()
                results[name] = asyncio.run(interference(server.url, prefix, args, rng))
            finally:
                reps.stack.stop()
            r = results[name]
            print(f"{name}: stream ITL p50 {r['stream_itl']['p50_ms']:.0f} ms p99 {r['stream_itl']['p99_ms']:.0f} "
                  f"ms; long-prompt TTFT p50 {r['long_ttft'].get('p50_ms', float('nan')):.0f} ms; goodput "
                  f"{r['goodput_req_per_s']:.2f} req/s under the SLO; hand-over {r['handover']}", flush=True)
        results["itl_p99_disaggregated_over_colocated"] = (results["disaggregated"]["stream_itl"]["p99_ms"]
                                                           / results["colocated"]["stream_itl"]["p99_ms"])
        if args.fault_requests:
            prefix = f"bench-pd-faults-{time.time_ns()}"
            reps = Replicas(args, server.url, prefix)
            reps.start("prefill", "prefill")
            reps.start("decode", "decode")
            try:
                reps.wait()
                results["faults"] = asyncio.run(faults(server.url, prefix, reps, args, rng))
            finally:
                reps.stack.stop()
            print(f"faults: {results['faults']}", flush=True)
    finally:
        server.close()
    results["finished"] = time.time()
    write_with_plot("pd", results, args.out, plot)
    return 0


def plot(results: dict, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [n for n in ("colocated", "disaggregated") if n in results]
    for q, off in (("p50_ms", -0.2), ("p99_ms", 0.2)):
        axes[0].bar([i + off for i in range(len(names))], [results[n]["stream_itl"][q] for n in names], width=0.4,
                    label=f"ITL {q[:3]}")
    axes[0].set_xticks(range(len(names)), names)
    axes[0].set(ylabel="ms", title="decoding streams while long prompts arrive")
    axes[0].legend()
    axes[1].bar(names, [results[n]["long_ttft"].get("p50_ms", 0) for n in names])
    axes[1].set(ylabel="ms", title="long prompts: TTFT p50")
    fig.suptitle(f"decodelab bench pd: {results['model']} {results['quantization']}, one thread per replica; "
                 f"{results['cpu']['label']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
