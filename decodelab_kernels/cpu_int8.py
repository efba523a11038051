"""8-bit weight x int16-quantized activation matmul for x86 CPUs with AVX2 (`cpu_int8.c`), AVX-512 F + BW
(`cpu_int8_avx512.c`: the same format, integers and bits, 16 outputs a 512-bit register) or AVX512-VNNI
(`cpu_int8_vnni.c`: the same format and integer products, vpdpbusd on the weights' bytes as stored and each int16
activation split into two signed bytes), built on first use.

The weights are 8-bit codes in groups of 32 along K, each group with its own step and offset (`GroupedInt8`,
`quantize`; fp32, or fp16 where that holds them exactly, as a GGUF's: `Matrix.half`): a group's 256 levels span its
own [min, max], as llama.cpp's Q4_1 / Q5_1 blocks do, so SmolLM2's Q4_1 weights (16 levels a group) are kept
exactly, and `Matrix` stores such a weight as its 4-bit codes (`four_bit`, two a byte): half the bytes a decode step
reads, the same operations per weight. A group on llama.cpp's Q8_0 grid keeps that grid (SmolLM2's head).

On SmolLM2-135M (docs/kernels.md) per-row symmetric int8, the format before, moved continuation log-likelihoods
by up to 0.25 nats and perplexity by up to +1.0% even with exact activations; symmetric groups of 32 (Q8_0's
form) still 0.09 nats; integer steps and offsets on a per-row grid (all-integer sums) 0.10 nats in the engine;
this format 0.022.

Why our own kernel: for the 1-11 rows of a decode step PyTorch's choices were either slow or lossy on the
2-core AVX2 target. fbgemm's int8 path quantizes the activations to 8 bits (weights limited to 7 bits by AVX2's
int16 pair sums), which needs SmoothQuant and fails on the outlier-heavy inputs of down_proj and the LM head, and
pays ~60 us of its own per call at one row; fp16 weights move twice int8's bytes; `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` have no fast AVX2 path (2-65x and ~10x slower than fp32). This kernel quantizes
each activation row to int16 (a relative error of ~1.5e-5, nothing to calibrate) and multiplies it by the 8-bit
codes in integers (vpmaddwd), one fp32 multiply-add per group of 32 and 8 or 16 outputs, reading each weight byte
from memory once per call; the weights are packed at load time (`pack_wide`) so that a register holds 16 (AVX2: 8)
outputs, one a lane, and each slab of 16 outputs is one sequential stream (docs/kernels.md has the measurements).

Which build runs (`default_isa()`): the AMX one ("amx": the VNNI source with -DDL_AMX, its blocks of 16 rows through
AMX-INT8's tiles, the same bits; cpu_amx.h) where the CPU has amx_tile and amx_int8 too and Linux grants the
process the tiles' state, else the VNNI one where it has avx512f, avx512bw and avx512_vnni and it builds, else the
AVX-512 one where it has the first two, else the AVX2 one; DECODELAB_CPU_ISA=avx2 forces the AVX2 build on any CPU
(int8_linear's DECODELAB_INT8_KERNEL=amx, =avx512vnni or =avx512 insists on one of the others; =avx512vnni is the
AMX machine's fallback). All three pack
their weights in slabs of 16 outputs, one a register lane (`pack_wide`: 2 k a lane for vpmaddwd in the AVX2 and
AVX-512 builds, which share the layout, 4 for the VNNI build's vpdpbusd), so a `Matrix` belongs to one build (or to
both of the first two). Their blocks take every row, a prompt's and a generated token's alike, batch-invariant; the
AVX2 and AVX-512 builds carried a second, many-rows matmul for prompt rows until session 33 (rows in the lanes:
`cpu_int8_rows.h`), when the outputs-in-lanes blocks came to run as fast or faster from 64 rows on.
"avx512-simde", "avx512vnni-simde" and "amx-simde" are the AVX-512 sources compiled against SIMDe's portable
intrinsics (Debian's libsimde-dev; the last with AMX's tiles emulated in plain C): how the tests check those builds'
logic on a CPU without the instructions (16-40x slower than the
AVX2 build on Zen 3; never chosen by `default_isa()`).

The first call (`unavailable()` or `linear()`) compiles the source (decodelab_kernels/_cbuild.py: the system C compiler,
-O3 -mavx2 -mfma -mf16c -fopenmp, into `$DECODELAB_CACHE_DIR/kernels`, once per source version). `unavailable()` says
why not when the CPU lacks AVX2, FMA or F16C, there is no compiler, or the build fails: callers
(int8_linear.int8_kernel) then fall back to PyTorch's kernels.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from decodelab_kernels import _cbuild


def _declare(lib: ctypes.CDLL) -> None:
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.dl_int8_linear.argtypes = [p, i64, i64, i64, p, p, p, p, p, i64, ctypes.c_int]
    lib.dl_int8_linear.restype = ctypes.c_int


def _amx_granted(lib: ctypes.CDLL) -> str | None:
    """None once Linux has granted this process AMX's tile state (arch_prctl), else why not (a kernel before 5.16,
    or a hypervisor that does not pass AMX through)."""
    lib.dl_int8_ready.restype = ctypes.c_int
    return None if lib.dl_int8_ready() == 0 else "Linux refused this process AMX's tile state (arch_prctl)"


_VNNI = ("-mavx512f", "-mavx512bw", "-mavx512vnni")
_AMX = ("-DDL_AMX", "-mamx-tile", "-mamx-int8")
KERNELS = {
    "amx": _cbuild.CKernel("cpu_int8_vnni", _declare, _VNNI + _AMX,
                           ("avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"), _amx_granted),
    "avx512vnni": _cbuild.CKernel("cpu_int8_vnni", _declare, _VNNI, ("avx512f", "avx512bw", "avx512_vnni")),
    "avx512": _cbuild.CKernel("cpu_int8_avx512", _declare, ("-mavx512f", "-mavx512bw"), ("avx512f", "avx512bw")),
    "avx2": _cbuild.CKernel("cpu_int8", _declare),
    "avx512-simde": _cbuild.CKernel("cpu_int8_avx512", _declare, ("-DDL_SIMDE", "-Wno-psabi")),
    "avx512vnni-simde": _cbuild.CKernel("cpu_int8_vnni", _declare, ("-DDL_SIMDE", "-Wno-psabi")),
    "amx-simde": _cbuild.CKernel("cpu_int8_vnni", _declare,
                                 ("-DDL_SIMDE", "-Wno-psabi", "-DDL_AMX", "-DDL_AMX_EMULATE"), probe=_amx_granted),
}
# By source (a build's and its SIMDe twin's): the int16 code of a row's largest |x| (its grid: max |x| / this; the
# VNNI build splits codes into two int8s).
ACTIVATION_MAX = {"cpu_int8": 32767, "cpu_int8_avx512": 32767, "cpu_int8_vnni": 32639}
# By source: the neighbouring k a lane of `pack_wide`'s slabs holds (vpdpbusd's 4 bytes, vpmaddwd's 2 int16).
LANE_K = {"cpu_int8_vnni": 4, "cpu_int8_avx512": 2, "cpu_int8": 2}
def default_isa() -> str:
    """The build a `Matrix` uses unless told: "amx" where it runs, else "avx512vnni" where that does, else "avx512"
    (while DECODELAB_CPU_ISA allows AVX-512), else "avx2"."""
    if _cbuild.cpu_isa() not in ("avx2", "generic"):
        for name in ("amx", "avx512vnni", "avx512"):
            if KERNELS[name].unavailable() is None:
                return name
    return "avx2"


def kernel(name: str | None = None) -> _cbuild.CKernel:
    """The library of build `name` (default: `default_isa()`)."""
    return KERNELS[name or default_isa()]


def unavailable(name: str | None = None) -> str | None:
    """None if build `name` (default: `default_isa()`'s) runs here, else why not."""
    return kernel(name).unavailable()

GROUP = 32  # weights along K that share a step and an offset: llama.cpp's block (Q8_0, Q4_1)


@dataclass(frozen=True)
class GroupedInt8:
    """A [n, k] weight as w[i, j] ~= d[i, g] * u[i, j] + m[i, g], g = j // GROUP: 8-bit codes u (uint8, K padded with
    zeros to a multiple of GROUP) and per group of GROUP an fp32 step d and offset m. A group's 256 levels span its
    own [min, max] (asymmetric, as llama.cpp's Q4_1 / Q5_1 blocks)."""
    u: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    k: int

    @property
    def n(self) -> int:
        return self.u.shape[0]

    def dequantize(self) -> torch.Tensor:
        """[n, k] fp32."""
        n, g = self.d.shape
        w = self.u.view(n, g, GROUP).float() * self.d[..., None] + self.m[..., None]
        return w.view(n, g * GROUP)[:, :self.k]

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor) -> GroupedInt8:
        """Per-row symmetric int8 (q [n, k], scale [n]) in this form: u = q + 128, d = scale, m = -128 * scale."""
        n, k = q.shape
        g = -(-k // GROUP)
        u = torch.nn.functional.pad(q.short() + 128, (0, g * GROUP - k)).to(torch.uint8)
        d = scale.float()[:, None].expand(n, g).contiguous()
        return cls(u, d, -128 * d, k)


def quantize(weight: torch.Tensor) -> GroupedInt8:
    """weight [n, k] float -> GroupedInt8: per group, m its minimum and d its range / 255 (0 for a constant group);
    except a group already on a symmetric 8-bit grid (llama.cpp's Q8_0: d * q, q in -127..127, d = max|w| / 127),
    which keeps that grid exactly (d, u = q + 128, m = -128 d), unless the weight is on a 4-bit grid (`four_bit`)."""
    w = weight.detach().float()
    n, k = w.shape
    g = -(-k // GROUP)
    groups = torch.nn.functional.pad(w, (0, g * GROUP - k)).view(n, g, GROUP)
    lo, hi = groups.amin(2), groups.amax(2)
    d = (hi - lo) / 255
    u = ((groups - lo[..., None]) / torch.where(d > 0, d, 1.0)[..., None]).round_().clamp_(0, 255)
    if not four_bit(u.to(torch.uint8)):
        sd = groups.abs().amax(2) / 127
        q = groups / torch.where(sd > 0, sd, 1.0)[..., None]
        # a Q8_0 group (3+ distinct values: fewer, as in a padded tail, are exact on their min / max grid anyway)
        qr = q.round()
        inner = (qr > qr.amin(2, keepdim=True)) & (qr < qr.amax(2, keepdim=True))  # a level between its ends
        grid = ((q - qr).abs() <= 1e-6).all(2) & inner.any(2)
        u = torch.where(grid[..., None], qr + 128, u)
        d, lo = torch.where(grid, sd, d), torch.where(grid, -128 * sd, lo)
    return GroupedInt8(u.view(n, g * GROUP).to(torch.uint8), d, lo, k)


def four_bit(u: torch.Tensor) -> bool:
    """Whether 8-bit codes u are 4-bit ones times 17: a group quantized from 16 levels spanning its [min, max]
    (llama.cpp's Q4_1, whose groups span exactly that: SmolLM2's GGUF) lands on 0, 17, ..., 255."""
    # u % 17 on uint8 runs ~1.5 s over SmolLM2's weights at load; times 17's inverse mod 256 (241), in uint8's
    # wrapping arithmetic, takes 17k (k = 0..15) to k and every other byte above 15 (only in uint8: float codes
    # never wrap, which for a session sent most of SmolLM2's Q4_1 groups through the Q8_0 check below)
    assert u.dtype == torch.uint8, u.dtype
    return bool(((u * 241) <= 15).all())


def _nibble_bytes(u4: torch.Tensor) -> torch.Tensor:
    """4-bit codes u4 [N, Kp] as [N, Kp / 32, 16] bytes: byte j of a group = u4[j] | u4[16 + j] << 4 (so a byte's low
    nibble is the group's k j and its high one k 16 + j)."""
    n, kp = u4.shape
    assert kp % GROUP == 0 and bool((u4 < 16).all()), kp
    halves = u4.view(n, kp // GROUP, 2, 16)
    return halves[:, :, 0] | (halves[:, :, 1] << 4)


WIDE = 16  # every build's slab: outputs a zmm holds (AVX2: two ymm), one a lane (`pack_wide`)


def pack_wide(u: torch.Tensor, nibbles: bool, lane: int = 4) -> torch.Tensor:
    """Codes u [N, Kp] (8-bit, or 4-bit ones < 16 with `nibbles`) in the VNNI (lane=4) or AVX2 / AVX-512 (lane=2)
    builds' layout: slabs of 16 output rows (N padded with zero rows to a multiple of 16), each weight group's codes
    as 32 / lane (4-bit: 16 / lane) pieces, piece q holding each of the 16 rows' `lane` bytes at k lane q ..
    lane (q + 1) - 1 (4-bit: `_nibble_bytes`' bytes there, so low nibbles k lane q.., high ones k 16 + lane q..):
    [ceil(N / 16), Kp / 32, 32 / lane or 16 / lane, 16, lane]. A register of a piece multiplies 16 outputs (AVX2: 8,
    from each of its two halves) at once."""
    rows = _nibble_bytes(u) if nibbles else u.view(u.shape[0], -1, GROUP)  # [N, G, 16 or 32]
    padded = torch.nn.functional.pad(rows, (0, 0, 0, 0, 0, -u.shape[0] % WIDE))
    s, g, b = padded.shape[0] // WIDE, padded.shape[1], padded.shape[2]
    return padded.view(s, WIDE, g, b // lane, lane).permute(0, 2, 3, 1, 4).contiguous()


def pack_wide_scales(d: torch.Tensor, dtype: torch.dtype = torch.float32, groups: int | None = None) -> torch.Tensor:
    """Steps or offsets d [N, G] for `pack_wide`'s slabs: [ceil(N / 16), groups (default G), 16] in `dtype`, zeros
    past N and G (offsets take G rounded up to 8: the kernel's Gp)."""
    groups = groups or d.shape[1]
    padded = torch.nn.functional.pad(d.float(), (0, groups - d.shape[1], 0, -d.shape[0] % WIDE))
    return padded.view(-1, WIDE, groups).transpose(1, 2).to(dtype).contiguous()


def fp16_exact(t: torch.Tensor) -> bool:
    """Whether fp16 holds every value of t to 2^-16 of itself: a GGUF's Q4_1 / Q8_0 scales, fp16 to begin with, pass
    after our fp32 arithmetic on them (~1e-6 off); a scale computed from fp32 weights lands that close to an fp16
    value 1 time in 32, so a matrix of them never passes."""
    h = t.half().float()
    return bool(h.isfinite().all() and ((h - t).abs() <= t.abs() * 2.0**-16).all())


def nibbles_enabled() -> bool:
    """DECODELAB_INT8_NIBBLES=0 keeps every weight in 8-bit codes (the fallback, and an A/B switch)."""
    return os.environ.get("DECODELAB_INT8_NIBBLES", "1") != "0"


def half_scales_enabled() -> bool:
    """DECODELAB_INT8_HALF_SCALES=0 keeps every step and offset in fp32 (the fallback, and an A/B switch)."""
    return os.environ.get("DECODELAB_INT8_HALF_SCALES", "1") != "0"


FMT_NIBBLES, FMT_HALF = 1, 2  # Matrix.fmt's bits, as decodelab_kernels/cpu_int8.h defines them


class Matrix:
    """A GroupedInt8 weight (and bias [N] fp32), checked and packed once: `m(x)` = x @ w.T + bias with ~4 us less
    per call (121 calls in a SmolLM2 decode step). Holds the packed copies only. A weight whose codes are all 4-bit
    ones (`four_bit`: a Q4_1 GGUF's) is packed as 4-bit codes with 17x the steps: the same weights (to an fp32
    rounding of each step), half the bytes a decode step reads (`nibbles`). `isa`: the build that multiplies
    (default `default_isa()`), whose layout it is packed in."""

    def __init__(self, w: GroupedInt8, bias: torch.Tensor | None = None, isa: str | None = None):
        assert w.u.dtype == torch.uint8 and w.d.dtype == w.m.dtype == torch.float32 and w.u.device.type == "cpu"
        assert bias is None or (bias.dtype == torch.float32 and bias.shape == (w.n,))
        self.isa = isa or default_isa()
        self.kernel = KERNELS[self.isa]
        self.nibbles = nibbles_enabled() and four_bit(w.u)
        codes, steps = (w.u // 17, w.d * 17) if self.nibbles else (w.u, w.d)
        # fp16 steps and offsets where that rounds none of them (a GGUF's): 4 bytes fewer per 32 weights
        self.half = half_scales_enabled() and fp16_exact(steps) and fp16_exact(w.m)
        dtype = torch.float16 if self.half else torch.float32
        self.packed = pack_wide(codes, self.nibbles, LANE_K[self.kernel.name])
        self.steps = pack_wide_scales(steps, dtype)
        self.offsets = pack_wide_scales(w.m, dtype, -(-w.m.shape[1] // 8) * 8)
        self.fmt = FMT_NIBBLES * self.nibbles | FMT_HALF * self.half
        self.bias = None if bias is None else bias.contiguous()
        self.n, self.k = w.n, w.k
        self._ptrs = (self.packed.data_ptr(), self.steps.data_ptr(), self.offsets.data_ptr(),
                      None if bias is None else self.bias.data_ptr(), self.fmt)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 on the CPU -> [M, N] fp32."""
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[-1] == self.k
        if x.stride(1) != 1 or x.stride(0) < self.k:
            x = x.contiguous()
        out = torch.empty(x.shape[0], self.n)
        if x.shape[0]:
            packed, steps, offsets, bias, fmt = self._ptrs
            if self.kernel.lib.dl_int8_linear(x.data_ptr(), x.stride(0), x.shape[0], self.k, packed, steps, offsets,
                                              bias, out.data_ptr(), self.n, fmt):
                raise MemoryError("cpu_int8: no memory for the int16 copy of the activations")
        return out


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           isa: str | None = None) -> torch.Tensor:
    """x [M, K] fp32 (CPU) @ q [N, K] int8, times scale [N] fp32, plus bias [N] fp32 -> [M, N] fp32."""
    return Matrix(GroupedInt8.from_int8(q, scale), bias, isa)(x)
