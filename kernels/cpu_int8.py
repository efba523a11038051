"""int8 weight x int16-quantized activation matmul for x86 CPUs with AVX2 (`cpu_int8.c`), built on first use.

Why our own kernel: for the 1-11 rows of a decode step PyTorch's choices were either slow or lossy on the
2-core AVX2 target. fbgemm's int8 path quantizes the activations to 8 bits (weights limited to 7 bits by AVX2's
int16 pair sums), which needs SmoothQuant and fails on the outlier-heavy inputs of down_proj and the LM head, and
pays ~60 us of its own per call at one row; fp16 weights move twice int8's bytes; `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` have no fast AVX2 path (2-65x and ~10x slower than fp32). This kernel quantizes
each activation row to int16 (a relative error of ~1.5e-5, nothing to calibrate) and multiplies it by 8-bit
weights in integers (vpmaddwd), reading each weight byte from memory once per call; the weights are packed at
load time (`pack`) so that each group of 4 output rows is one sequential stream (docs/kernels.md has the
measurements). An earlier version kept the activations in fp32 and widened the weights to fp32 for FMA: the same
results within int16's rounding, at ~1.5x the time for 8 rows.

The first call (`unavailable()` or `linear()`) compiles `cpu_int8.c` (kernels/_cbuild.py: the system C compiler,
-O3 -mavx2 -mfma -fopenmp, into `$DECODELAB_CACHE_DIR/kernels`, once per source version). `unavailable()` says
why not when the CPU lacks AVX2 or FMA, there is no compiler, or the build fails: callers
(int8_linear.int8_kernel) then fall back to PyTorch's kernels.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import _cbuild


def _declare(lib: ctypes.CDLL) -> None:
    lib.dl_int8_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.dl_int8_linear.restype = ctypes.c_int


KERNEL = _cbuild.CKernel("cpu_int8", _declare)
unavailable = KERNEL.unavailable  # None if the kernel runs here, else why not


def pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 in the kernel's layout: groups of 4 output rows (N padded with zero rows to a multiple of 4),
    K padded with zeros to a multiple of 16, each group's rows interleaved in 16-byte pieces per k-step, so a
    group is one sequential stream: [ceil(N / 4), ceil(K / 16), 4, 16]."""
    n, k = q.shape
    padded = torch.nn.functional.pad(q, (0, -k % 16, 0, -n % 4))
    return padded.view(padded.shape[0] // 4, 4, padded.shape[1] // 16, 16).transpose(1, 2).contiguous()


class Matrix:
    """q [N, K] int8 with its scale [N] (and bias [N]) fp32, checked and packed once: `m(x)` = linear(x, q, scale,
    bias) with ~4 us less per call (121 calls in a SmolLM2 decode step). Holds the packed copy only."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        assert q.dtype == torch.int8 and q.dim() == 2 and scale.dtype == torch.float32 and scale.shape == q.shape[:1]
        assert bias is None or (bias.dtype == torch.float32 and bias.shape == q.shape[:1])
        self.packed, self.scale = pack(q), scale.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.n, self.k = q.shape
        self._ptrs = (self.packed.data_ptr(), self.scale.data_ptr(), None if bias is None else self.bias.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 on the CPU -> [M, N] fp32."""
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[-1] == self.k
        if x.stride(1) != 1 or x.stride(0) < self.k:
            x = x.contiguous()
        out = torch.empty(x.shape[0], self.n)
        if x.shape[0]:
            packed, scale, bias = self._ptrs
            if KERNEL.lib.dl_int8_linear(x.data_ptr(), x.stride(0), x.shape[0], self.k, packed, scale, bias,
                                         out.data_ptr(), self.n):
                raise MemoryError("cpu_int8: no memory for the int16 copy of the activations")
        return out


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 (CPU) @ q [N, K] int8, times scale [N] fp32, plus bias [N] fp32 -> [M, N] fp32."""
    return Matrix(q, scale, bias)(x)
