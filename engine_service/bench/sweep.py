"""The concurrency sweep of `decodelab bench serve --sweep`: C streaming clients at once through one replica's OpenAI
API (HTTP + SSE, as real clients come), for C from 1 to 2,048; the same C requests in-process beside it.

Per level: errors (HTTP status or error chunk, by kind), TTFT and inter-token latency percentiles, goodput (output
tokens of successful requests per second of wall time) and requests/s. The in-process engine runs the same burst of
C requests (no HTTP, no Redis): TTFT p50 and throughput against the service's at the same concurrency.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

from engine_service.bench.common import percentiles_ms, pyplot


async def http_burst(api_url: str, model: str, prompts: list[list[int] | str], max_tokens: int) -> dict:
    """Every prompt at once as a streaming completion; what each client saw."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=api_url, timeout=httpx.Timeout(900, connect=60), limits=limits) as http:

        async def one(prompt: list[int] | str) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
            t0, times, error, finish, usage = time.perf_counter(), [], None, None, None
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        detail = json.loads(await r.aread()).get("error", {})
                        return {"error": f"http {r.status_code} {detail.get('code')}: {detail.get('message', '')[:60]}",
                                "times": [], "t0": t0}
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = f"stream error {chunk['error'].get('code')}"
                            continue
                        usage = chunk.get("usage") or usage
                        for choice in chunk["choices"]:
                            # a token whose text is empty so far sends no chunk: times are per text delta
                            n = max(1, len((choice.get("logprobs") or {}).get("tokens") or []))
                            if choice.get("text"):
                                times += [time.perf_counter()] * n
                            finish = choice.get("finish_reason") or finish
            except (httpx.HTTPError, ValueError) as e:
                error = f"{type(e).__name__}"
            if error is None and finish != "length":
                error = f"finish_reason {finish}"
            tokens = usage["completion_tokens"] if usage else len(times)
            return {"error": error, "times": times, "t0": t0, "tokens": tokens}

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    return _summary(results, wall)


def _summary(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [r["times"][0] - r["t0"] for r in ok if r["times"]]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:]) if b > a]  # one event may carry several
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(results), "ok": len(ok), "errors": dict(Counter(r["error"] for r in results if r["error"])),
            "wall_s": wall, "goodput_tok_per_s": tokens / wall, "req_per_s": len(ok) / wall,
            "ttft": percentiles_ms(ttft), "itl": percentiles_ms(itl)}


def inprocess_burst(engine, prompts: list[list[int] | str], max_tokens: int) -> dict:
    from engine_service.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"sweep-{start}-{i}", p, params)
    first: dict[str, float] = {}
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return {"requests": len(prompts), "wall_s": wall, "goodput_tok_per_s": tokens / wall,
            "ttft": percentiles_ms([t - start for t in first.values()])}


def sweep(engine, api_url: str, model: str, levels: list[int], prompt_len: int, max_tokens: int, seed: int,
          inprocess_max: int = 256) -> list[dict]:
    rng = random.Random(seed)
    vocab = engine.vocab_size
    out = []
    asyncio.run(http_burst(api_url, model, [[7] * 8] * 2, 4))  # warm-up
    for c in levels:
        prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(c)]
        level = {"concurrency": c, "api": asyncio.run(http_burst(api_url, model, prompts, max_tokens))}
        if c <= inprocess_max:  # fresh prompts: the API run filled the prefix cache of the replica, not this engine
            level["inprocess"] = inprocess_burst(engine, prompts, max_tokens)
            level["ttft_p50_delta_ms"] = level["api"]["ttft"].get("p50_ms", float("nan")) - \
                level["inprocess"]["ttft"]["p50_ms"]
            level["throughput_ratio"] = level["api"]["goodput_tok_per_s"] / level["inprocess"]["goodput_tok_per_s"]
        api, nan = level["api"], float("nan")
        line = (f"concurrency {c:5d}: {api['ok']}/{api['requests']} ok, errors {api['errors'] or 0}, "
                f"TTFT p50 {api['ttft'].get('p50_ms', nan):.0f} ms p99 {api['ttft'].get('p99_ms', nan):.0f} ms, "
                f"ITL p50 {api['itl'].get('p50_ms', nan):.1f} ms, goodput {api['goodput_tok_per_s']:.1f} tok/s")
        if "inprocess" in level:
            line += (f"; in-process TTFT p50 {level['inprocess']['ttft']['p50_ms']:.0f} ms, "
                     f"{level['inprocess']['goodput_tok_per_s']:.1f} tok/s")
        print(line, flush=True)
        out.append(level)
    return out


def plot_sweep(levels: list[dict], path, title: str) -> None:
    plt = pyplot()

    cs = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for q in ("p50_ms", "p99_ms"):
        axes[0].plot(cs, [lv["api"]["ttft"].get(q) for lv in levels], "-o", label=f"API {q[:3]}")
        axes[1].plot(cs, [lv["api"]["itl"].get(q) for lv in levels], "-o", label=f"API {q[:3]}")
    inproc = [lv for lv in levels if "inprocess" in lv]
    axes[0].plot([lv["concurrency"] for lv in inproc], [lv["inprocess"]["ttft"]["p50_ms"] for lv in inproc], "--s",
                 label="in-process p50")
    axes[2].plot(cs, [lv["api"]["goodput_tok_per_s"] for lv in levels], "-o", label="API goodput")
    axes[2].plot([lv["concurrency"] for lv in inproc], [lv["inprocess"]["goodput_tok_per_s"] for lv in inproc],
                 "--s", label="in-process")
    for ax, name in zip(axes, ("TTFT (ms)", "inter-token latency (ms)", "tok/s")):
        ax.set(xscale="log", xlabel="concurrent streaming clients", ylabel=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    errors = sum(sum(lv["api"]["errors"].values()) for lv in levels)
    fig.suptitle(f"{title}; errors over the sweep: {errors}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
