"""Shared pieces of the benchmarks: workloads, the CPU's matmul peak, latency percentiles, a replica's
/metrics, JSON + plot output."""
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def mixed_workload(num_requests: int, vocab_size: int, seed: int = 0, prompt_range=(16, 512),
                   mean_output: float = 100, output_range=(8, 512)) -> Workload:
    """Traffic-shaped: uniform prompt lengths, exponential output lengths (clipped), fixed seed."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        length = rng.randint(*prompt_range)
        prompts.append([rng.randrange(100, vocab_size) for _ in range(length)])
        out = int(round(rng.expovariate(1 / mean_output)))
        max_tokens.append(min(max(out, output_range[0]), output_range[1]))
    return Workload(prompts, max_tokens)


def matmul_peak_gflops(sizes: tuple[int, ...] = (1024, 2048, 3072, 4096), repeats: int = 3) -> dict:
    """Best fp32 GEMM rate over a few square sizes with the current torch threads (the roofline's roof),
    for torch's default path and, where available, the oneDNN packed path the engine runs on CPU."""
    from engine_service.engine.models.packed_linear import pack_weight, packed_linear, packing_enabled

    paths = {"torch_mm": lambda a, b: a @ b}
    if packing_enabled(torch.device("cpu"), torch.float32):
        paths["onednn_packed"] = lambda a, b: packed_linear(a, b, None)
    best = {name: 0.0 for name in paths}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for name, fn in paths.items():
            w = b if name == "torch_mm" else pack_weight(b)
            fn(a, w)
            for _ in range(repeats):
                t = time.perf_counter()
                fn(a, w)
                best[name] = max(best[name], 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return {"gflops": max(best.values()), "by_path": best}


def percentiles_ms(xs: list[float]) -> dict:
    """p50/p90/p99/mean of durations in seconds, in ms ({} when there are none)."""
    if not xs:
        return {}
    import numpy as np

    p50, p90, p99 = np.percentile(xs, [50, 90, 99])
    return {"p50_ms": p50 * 1e3, "p90_ms": p90 * 1e3, "p99_ms": p99 * 1e3, "mean_ms": float(np.mean(xs)) * 1e3}


def scrape_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """A replica's /metrics as {sample name: value}; samples with a `state` label as `name[state]`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=timeout).text):
        for sample in family.samples:
            out[sample.name + (f"[{sample.labels['state']}]" if "state" in sample.labels else "")] = sample.value
    return out


def write_results(name: str, results: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=2))
    return path


def write_with_plot(name: str, results: dict, out_dir: str | Path, plot) -> Path:
    """`name`.json and, from `plot(results, png_path)`, `name`.png beside it; says where."""
    path = write_results(name, results, out_dir)
    plot(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend: benchmarks write PNG files and never open a window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


# The environment switches that force a fallback path: a figure taken under one says so (`cpu_info()["forced"]`).
FALLBACK_SWITCHES = ("DECODELAB_CPU_ISA", "DECODELAB_INT8_KERNEL", "DECODELAB_INT8_NIBBLES",
                     "DECODELAB_INT8_HALF_SCALES", "DECODELAB_CPU_KERNELS",
                     "DECODELAB_CPU_LINEAR")


def cpu_info() -> dict:
    """The CPU a figure came from: model name, cores, and the vector ISA the kernels can use (AVX-512 or AVX2)."""
    import os
    import platform

    model, flags, ids = platform.processor() or platform.machine(), set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key in ("cpu family", "model") and key not in ids:
                    ids[key] = value.strip()  # a hypervisor may mask the name ("AMD EPYC"); these still tell
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    isa = ("avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other") if flags else "unknown"
    extras = sorted(f for f in flags if f in ("avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16"))
    from decodelab_kernels import (  # the builds this process runs (None: none of ours builds)
        cpu_decode_attention,
        cpu_int8,
    )

    int8_isa = cpu_int8.default_isa() if cpu_int8.unavailable() is None else None
    attention_isa = cpu_decode_attention.build_name() if cpu_decode_attention.unavailable() is None else None
    forced = {k: os.environ[k] for k in FALLBACK_SWITCHES if os.environ.get(k)}
    label = f"{model} ({os.cpu_count()} cores, {isa.upper()}{', ' + ', '.join(extras) if extras else ''})"
    if forced:
        label += " forced " + " ".join(f"{k}={v}" for k, v in forced.items())
    return {"model": model, "family": ids.get("cpu family"), "model_id": ids.get("model"), "cores": os.cpu_count(),
            "isa": isa, "isa_extras": extras, "int8_isa": int8_isa, "attention_isa": attention_isa, "forced": forced,
            "label": label}
