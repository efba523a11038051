# GPU check + benchmark of the Triton kernels (not part of CI: needs a CUDA card).
#   python -m engine_service.bench.gpu_kernels --out results.json
# 1) every *_triton kernel against its *_torch reference on CUDA (fp32/fp16/bf16, GQA 1/3/4/6, pages 8/16);
# 2) paged_decode_attention_triton timed at Qwen2.5-1.5B shapes (12 q heads, 2 KV heads, head_dim 128, bf16):
#    achieved bandwidth = bytes of K/V + q read / time, against the card's peak and a measured copy.
# Exit status 1 if any check fails. `--device cpu --quick` under TRITON_INTERPRET=1 dry-runs the script.
import argparse
import json
import sys
import time
from pathlib import Path

import torch

import decodelab_kernels as kernels
from engine_service.engine.utils import cdiv

PEAK_GBS = [  # spec HBM bandwidth by device-name substring, first match wins
    ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935), ("A100", 1555), ("L40S", 864), ("A10G", 600), ("A10", 600), ("L4", 300),
]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def paged_cache(lens, page, hkv, d, dtype, device, spare=4):
    need = [cdiv(n, page) for n in lens]
    nb = sum(need) + spare
    k = torch.randn(nb, page, hkv, d, device=device).to(dtype)
    v = torch.randn(nb, page, hkv, d, device=device).to(dtype)
    perm = torch.randperm(nb, device=device).to(torch.int32)  # scattered blocks
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32, device=device)
    start = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[start:start + n]
        start += n
    return k, v, tables, torch.tensor(lens, dtype=torch.int32, device=device)


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def check_kernels(device, quick):
    results = []
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    shapes = [(2, 2, 16, 8), (6, 2, 64, 16), (8, 2, 64, 8)]  # (heads, kv_heads, head_dim, page)
    if not quick:
        shapes += [(12, 2, 128, 16), (9, 3, 64, 16), (32, 8, 128, 16)]
    lens = [1, 17, 300, 64] if quick else [1, 17, 300, 64, 1000, 4097, 129, 2048]
    for dtype in dtypes:
        for h, hkv, d, page in shapes:
            case = f"{dtype} H={h} Hkv={hkv} D={d} page={page}"
            k, v, tables, ctx = paged_cache(lens, page, hkv, d, dtype, device)
            q = torch.randn(len(lens), h, d, device=device).to(dtype)
            ref = kernels.paged_decode_attention_torch(q, k, v, tables, ctx, d ** -0.5)
            for splits in (None, 1, 3):
                err = max_err(kernels.paged_decode_attention_triton(q, k, v, tables, ctx, d ** -0.5,
                                                                    num_splits=splits), ref)
                results.append(dict(kernel="paged_decode_attention", case=f"{case} splits={splits}",
                                    max_err=err, ok=err <= TOL[dtype] * 4))
            specs = [(300, 300), (1000, 77), (17, 1)] if not quick else [(70, 70), (45, 20), (9, 1)]
            k, v, tables, ctx = paged_cache([c for c, _ in specs], page, hkv, d, dtype, device)
            cu = torch.tensor([0] + torch.tensor([n for _, n in specs]).cumsum(0).tolist(), dtype=torch.int32,
                              device=device)
            q = torch.randn(int(cu[-1]), h, d, device=device).to(dtype)
            err = max_err(kernels.prefill_attention_triton(q, k, v, cu, ctx, tables, d ** -0.5),
                          kernels.prefill_attention_torch(q, k, v, cu, ctx, tables, d ** -0.5))
            results.append(dict(kernel="prefill_attention", case=case, max_err=err, ok=err <= TOL[dtype] * 4))
        caches = [torch.zeros(8, 16, 2, 64, dtype=dtype, device=device) for _ in range(4)]
        key, value = torch.randn(2, 20, 2, 64, device=device).to(dtype)
        slots = torch.randperm(128, device=device)[:20]
        slots[::5] = -1
        kernels.store_kvcache_torch(key, value, caches[0], caches[1], slots)
        kernels.store_kvcache_triton(key, value, caches[2], caches[3], slots)
        ok = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        results.append(dict(kernel="store_kvcache", case=str(dtype), max_err=0.0 if ok else float("nan"), ok=ok))
        kv = torch.randn(3, 2, 10, 16, 2, 64, device=device).to(dtype)
        expected = kv.clone()
        src, dst = torch.tensor([0, 4, 4], device=device), torch.tensor([7, 1, 9], device=device)
        kernels.copy_blocks_torch(expected, src, dst)
        kernels.copy_blocks_triton(kv, src, dst)
        ok = torch.equal(kv, expected)
        results.append(dict(kernel="copy_blocks", case=str(dtype), max_err=0.0 if ok else float("nan"), ok=ok))
    return results


def time_ms(fn):
    if torch.cuda.is_available():
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_gbs(device):
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB, far past L2
    y = torch.empty_like(x)
    return 2 * x.numel() / time_ms(lambda: y.copy_(x)) / 1e6  # read + write


def bench_decode(device, quick):
    h, hkv, d, page, dtype = 12, 2, 128, 16, torch.bfloat16
    batches, contexts = ([1, 2], [64, 128]) if quick else ([1, 4, 16, 32, 64], [1024, 2048, 4096, 8192])
    rows = []
    for b in batches:
        for ctx in contexts:
            k, v, tables, lens = paged_cache([ctx] * b, page, hkv, d, dtype, device)
            q = torch.randn(b, h, d, device=device).to(dtype)
            call = (q, k, v, tables, lens, d ** -0.5)  # timed right here: the lambdas need no loop binding
            ms = time_ms(lambda: kernels.paged_decode_attention_triton(*call))  # noqa: B023
            torch_ms = time_ms(lambda: kernels.paged_decode_attention_torch(*call))  # noqa: B023
            read = 2 * b * ctx * hkv * d * dtype.itemsize + q.numel() * q.element_size()
            rows.append(dict(batch=b, context=ctx, triton_ms=ms, torch_ms=torch_ms, bytes_read=read,
                             gbs=read / ms / 1e6))
            print(f"decode B={b:3d} ctx={ctx:5d}  {ms * 1e3:8.1f} us  {rows[-1]['gbs']:7.0f} GB/s"
                  f"  (torch {torch_ms * 1e3:8.1f} us)", flush=True)
            del k, v
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_kernels.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU dry run under TRITON_INTERPRET=1)")
    ap.add_argument("--peak-gbs", type=float, help="override the spec peak bandwidth of the card")
    args = ap.parse_args()
    assert args.device == "cpu" or torch.cuda.is_available(), "needs a CUDA device (or --device cpu --quick)"
    assert kernels.triton_available(), "needs triton"
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (triton interpreter)"
    peak = args.peak_gbs or next((gbs for key, gbs in PEAK_GBS if key in name), None)
    checks = check_kernels(args.device, args.quick)
    for c in checks:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['kernel']:24s} {c['case']:52s} max_err={c['max_err']:.2e}")
    measured = copy_gbs(args.device) if args.device == "cuda" else None
    rows = bench_decode(args.device, args.quick)
    for r in rows:
        r["fraction_of_peak"] = r["gbs"] / peak if peak else None
        r["fraction_of_copy"] = r["gbs"] / measured if measured else None
    report = dict(device=name, peak_gbs=peak, measured_copy_gbs=measured, torch=torch.__version__,
                  checks=checks, decode=rows, all_checks_ok=all(c["ok"] for c in checks))
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"device {name}: peak {peak} GB/s, measured copy {measured and round(measured)} GB/s;"
          f" best decode {max(r['gbs'] for r in rows):.0f} GB/s; checks ok: {report['all_checks_ok']} -> {args.out}")
    return 0 if report["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
