# Triton is an optional dependency: without it the modules still import (the torch paths work) and the
# *_triton functions fail with a clear message.
import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _Missing:
        constexpr = None  # kernel signatures annotate with tl.constexpr at definition time

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _Missing()

# Read once, as triton.jit does when the kernels are decorated: under the interpreter (CPU tests)
# tl.dot gives wrong results for bf16 inputs, so the kernels upcast bf16 tiles to fp32 there.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton() -> None:
    assert HAS_TRITON, "triton is not installed: use the *_torch kernels (pip install decodelab[triton])"


def dot_upcast(dtype: torch.dtype) -> bool:
    return INTERPRET and dtype == torch.bfloat16


@triton.jit
def load_kv_tile(k_ptr, v_ptr, bt_row_ptr, t, tmask, kvh, d, D, stride_kb, stride_kt, stride_kh,
                 PAGE: tl.constexpr, UPCAST: tl.constexpr, ks_ptr, vs_ptr, HKV: tl.constexpr,
                 QUANT: tl.constexpr, out_dtype: tl.constexpr):
    # K and V rows of one sequence's context positions `t`, found through its block table row;
    # QUANT: int8 rows times their own per-head scale ([num_blocks, PAGE, Hkv] fp32, kv_int8.py), as out_dtype
    blk = tl.load(bt_row_ptr + t // PAGE, mask=tmask, other=0).to(tl.int64)
    row = blk * stride_kb + (t % PAGE) * stride_kt + kvh * stride_kh
    srow = (blk * PAGE + t % PAGE) * HKV + kvh
    kv_mask = tmask[:, None] & (d[None, :] < D)
    k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0)
    v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0)
    if QUANT:
        ks = tl.load(ks_ptr + srow, mask=tmask, other=0.0)
        vs = tl.load(vs_ptr + srow, mask=tmask, other=0.0)
        k = (k.to(tl.float32) * ks[:, None]).to(out_dtype)
        v = (v.to(tl.float32) * vs[:, None]).to(out_dtype)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v
