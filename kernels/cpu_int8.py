"""8-bit weight x int16-quantized activation matmul for x86 CPUs with AVX2 (`cpu_int8.c`), built on first use.

The weights are 8-bit codes in groups of 32 along K, each group with its own integer step and offset on a per-row
grid (`GroupedInt8`, `quantize`): a group's 256 levels span its own [min, max], as llama.cpp's Q4_1 / Q5_1 blocks
do. Per-row symmetric int8, the format before, moved SmolLM2's continuation log-likelihoods by up to 0.26 nats and
its perplexity by up to +1% with exact activations; grouped symmetric int8 (Q8_0's form) still 0.09 nats; the
asymmetric groups 0.03 (docs/kernels.md).

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
from dataclasses import dataclass

import torch

from kernels import _cbuild


def _declare(lib: ctypes.CDLL) -> None:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.dl_int8_linear.argtypes = [p, i64, i64, i64, p, p, p, p, p, i64, ctypes.c_int32]
    lib.dl_int8_linear.restype = ctypes.c_int


KERNEL = _cbuild.CKernel("cpu_int8", _declare)
unavailable = KERNEL.unavailable  # None if the kernel runs here, else why not

GROUP = 32  # weights along K that share one (a, b): llama.cpp's block (Q8_0, Q4_1)
STEPS = 64  # the largest step multiplier a; scale is a row's widest group range / (255 * STEPS)
INT16 = 32767


@dataclass(frozen=True)
class GroupedInt8:
    """A [n, k] weight as w[i, j] ~= scale[i] * (a[i, g] * u[i, j] + b[i, g]), g = j // GROUP: 8-bit codes u (uint8,
    K padded with zeros to a multiple of GROUP), per group of GROUP an integer step a in [1, STEPS] and an integer
    offset b (int16), one fp32 scale per row. Each group's 256 levels span its own [min, max] (asymmetric, as
    llama.cpp's Q4_1 / Q5_1 blocks), and every a * u + b is an int16, so the kernel multiplies and sums in integers."""
    u: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    k: int

    @property
    def n(self) -> int:
        return self.u.shape[0]

    def integers(self) -> torch.Tensor:
        """[n, k] int32: a * u + b, what the kernel multiplies the int16 activations by."""
        n, g = self.a.shape
        ints = self.a.int()[..., None] * self.u.view(n, g, GROUP).int() + self.b.int()[..., None]
        return ints.view(n, g * GROUP)[:, :self.k]

    def dequantize(self) -> torch.Tensor:
        """[n, k] fp32."""
        return self.integers().float() * self.scale[:, None]

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor) -> GroupedInt8:
        """Per-row symmetric int8 (q [n, k], scale [n]) in this form, exactly: u = q + 128, a = 1, b = -128."""
        n, k = q.shape
        g = -(-k // GROUP)
        u = torch.nn.functional.pad(q.short() + 128, (0, g * GROUP - k)).to(torch.uint8)
        return cls(u, torch.ones(n, g, dtype=torch.int16), torch.full((n, g), -128, dtype=torch.int16),
                   scale.float().contiguous(), k)


def quantize(weight: torch.Tensor, steps: int = STEPS) -> GroupedInt8:
    """weight [n, k] float -> GroupedInt8. A group's step is scale * a >= its range / 255 (a rounded up, so its
    256 levels cover it), its offset scale * b its minimum rounded to the row's grid; scale is at least
    max|w| / (32767 - 510), so that no a * u + b leaves int16 (|b| <= max|w| / scale + 1/2, and
    b + 255 a <= max / scale + 255.5; a * u alone may pass it: the kernel's int16 arithmetic wraps, and the sum
    comes back in range)."""
    w = weight.detach().float()
    n, k = w.shape
    g = -(-k // GROUP)
    groups = torch.nn.functional.pad(w, (0, g * GROUP - k)).view(n, g, GROUP)
    lo, hi = groups.amin(2), groups.amax(2)
    widest, amax = (hi - lo).amax(1), w.abs().amax(1)
    scale = torch.maximum(widest / (255 * steps), amax / (INT16 - 2 * 255))
    scale = torch.where(scale > 0, scale, 1.0)
    a = torch.ceil((hi - lo) / (255 * scale[:, None])).clamp_(1, steps)
    b = torch.round(lo / scale[:, None])
    u = torch.round((groups / scale[:, None, None] - b[..., None]) / a[..., None]).clamp_(0, 255)
    assert torch.maximum(b.abs(), (b + 255 * a).abs()).max() <= INT16  # every a * u + b lies between the two
    return GroupedInt8(u.view(n, g * GROUP).to(torch.uint8), a.to(torch.int16), b.to(torch.int16), scale, k)


def pack(u: torch.Tensor) -> torch.Tensor:
    """u [N, Kp] (Kp a multiple of GROUP) in the kernel's layout: groups of 4 output rows (N padded with zero rows
    to a multiple of 4), each group's rows interleaved in 16-byte pieces per k-step, so a group is one sequential
    stream: [ceil(N / 4), Kp / 16, 4, 16]."""
    n, kp = u.shape
    assert kp % GROUP == 0, kp
    padded = torch.nn.functional.pad(u, (0, 0, 0, -n % 4))
    return padded.view(padded.shape[0] // 4, 4, kp // 16, 16).transpose(1, 2).contiguous()


def pack_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b [N, G] int16 as the kernel reads them beside `pack`'s groups: [ceil(N / 4), G, 4, 2]."""
    ab = torch.nn.functional.pad(torch.stack([a, b], dim=2), (0, 0, 0, 0, 0, -a.shape[0] % 4))
    return ab.view(ab.shape[0] // 4, 4, a.shape[1], 2).transpose(1, 2).contiguous()


def activation_max(w: GroupedInt8) -> int:
    """The largest |activation| the kernel quantizes to (int16's, unless a lane's int32 sum could overflow:
    a lane adds the products of every 16th pair of k, at most xmax * sum |a * u + b| over them)."""
    ints = torch.nn.functional.pad(w.integers().abs_(), (0, -w.k % 16)).view(w.n, -1, 8, 2)  # int32 sums fit
    lane = int(ints.sum(dim=(1, 3)).max()) if w.n else 0
    return min(INT16, (2**31 - 1) // max(lane, 1))


class Matrix:
    """A GroupedInt8 weight (and bias [N] fp32), checked and packed once: `m(x)` = x @ w.T + bias with ~4 us less
    per call (121 calls in a SmolLM2 decode step). Holds the packed copy only."""

    def __init__(self, w: GroupedInt8, bias: torch.Tensor | None = None):
        assert w.u.dtype == torch.uint8 and w.a.dtype == w.b.dtype == torch.int16 and w.scale.dtype == torch.float32
        assert bias is None or (bias.dtype == torch.float32 and bias.shape == (w.n,))
        self.packed, self.ab, self.scale = pack(w.u), pack_steps(w.a, w.b), w.scale.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.n, self.k, self.xmax = w.n, w.k, activation_max(w)
        self._ptrs = (self.packed.data_ptr(), self.ab.data_ptr(), self.scale.data_ptr(),
                      None if bias is None else self.bias.data_ptr(), self.xmax)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 on the CPU -> [M, N] fp32."""
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[-1] == self.k
        if x.stride(1) != 1 or x.stride(0) < self.k:
            x = x.contiguous()
        out = torch.empty(x.shape[0], self.n)
        if x.shape[0]:
            packed, ab, scale, bias, xmax = self._ptrs
            if KERNEL.lib.dl_int8_linear(x.data_ptr(), x.stride(0), x.shape[0], self.k, packed, ab, scale, bias,
                                         out.data_ptr(), self.n, xmax):
                raise MemoryError("cpu_int8: no memory for the int16 copy of the activations")
        return out


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 (CPU) @ q [N, K] int8, times scale [N] fp32, plus bias [N] fp32 -> [M, N] fp32."""
    return Matrix(GroupedInt8.from_int8(q, scale), bias)(x)
