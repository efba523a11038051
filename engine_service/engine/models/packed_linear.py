"""Linear layers with oneDNN-packed weights on CPU.

A decode step multiplies every weight once, so on CPU it is bound by how fast the GEMM library
streams weights from memory. PyTorch's default CPU path (MKL sgemv/sgemm on a row-major weight)
reaches ~16 GB/s here; the same weights reordered once into oneDNN's blocked layout stream at
~33 GB/s, and larger batches gain about as much (measured on SmolLM2's shapes, 2 threads:
1 row 36.7 -> 20.2 ms, 128 rows 239 -> 108 ms for all 121 matmuls). This is what PyTorch's own
inductor does for CPU linears; we do it at load time so eager mode gets it too.

The packed tensor replaces the dense weight (which moves to the meta device: shapes stay
inspectable, memory is not doubled). `DECODELAB_CPU_LINEAR=dense` turns packing off.

oneDNN builds (JIT-compiles) and caches one primitive per input shape, about 1 MB each, up to 1024
of them: with the row count of every step different, a replica's memory grew ~30 MB/min for
minutes (`decodelab bench soak`). So row counts are bucketed: 1-8 exact (decode, speculative
verification), then padded up to a multiple of 8 (to 64) or 16 (to 256), and longer inputs run in
chunks of 256 rows. That bounds the primitives at 27 per weight shape (~135 for a Llama, ~120 MB).

oneDNN's bf16 linears need avx512bw+vl+dq or avx_ne_convert (x86). On a CPU without them (AVX2 only,
e.g. AMD Zen 3) bf16 weights are packed as fp32 and the input is cast up and the output back: the
same math (bf16 products are exact in fp32, and oneDNN's bf16 path accumulates in fp32 too), 5-8x
faster than PyTorch's dense bf16 matmul there for 16-128 rows and 1.4x for one (Zen 3, 1 thread,
a 2048x576 weight), at the cost of fp32 weight memory. `DECODELAB_CPU_ISA=avx2` forces that
fallback on any CPU (tests use it).
"""
import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from decodelab_kernels import _cbuild
from engine_service.engine.models.int8_linear import HeadWeight, Int8Weight, RowSplitWeight, quantized
from engine_service.engine.utils import cdiv

_PACKABLE = (torch.float32, torch.bfloat16)  # fp16 packing needs AVX512-FP16 / AVX-NE-CONVERT


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in _PACKABLE and torch.backends.mkldnn.is_available()
            and os.environ.get("DECODELAB_CPU_LINEAR", "onednn") != "dense")


def bf16_packing_unavailable() -> str | None:
    """None if oneDNN can run bf16 linears on this CPU, else why not (the instructions it lacks)."""
    isa = _cbuild.cpu_isa()
    if isa in ("avx2", "generic"):
        return f"DECODELAB_CPU_ISA={isa}: treated as lacking avx512bw, avx512vl, avx512dq and avx_ne_convert"
    return _onednn_bf16_error()  # avx512 cannot add instructions the CPU lacks


@functools.cache
def _onednn_bf16_error() -> str | None:
    # oneDNN's own check, whatever the CPU family or build; its message names the instructions
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError as e:
        return str(e)
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense -> oneDNN blocked layout (an opaque mkldnn tensor), tuned for small batches.
    bf16 weights pack as fp32 where the CPU has no bf16 path (see the module docstring)."""
    weight = weight.detach().contiguous()
    if weight.dtype == torch.bfloat16 and bf16_packing_unavailable() is not None:
        weight = weight.float()
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


_CHUNK = 256


def bucket_rows(n: int) -> int:
    """The row count a `n`-row input (n <= _CHUNK) is padded to."""
    if n <= 8:
        return n
    step = 8 if n <= 64 else 16
    return cdiv(n, step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != packed.dtype:  # bf16 model, weight packed as fp32
        bias = None if bias is None else bias.to(packed.dtype)
        return packed_linear(x.to(packed.dtype), packed, bias).to(x.dtype)
    n = x.shape[0]
    if n > _CHUNK:
        return torch.cat([packed_linear(part, packed, bias) for part in x.split(_CHUNK)])
    rows = bucket_rows(n)
    if rows != n:
        x = F.pad(x, (0, 0, 0, rows - n))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if rows == n else out[:n]


class Linear(nn.Linear):
    """nn.Linear that runs from a packed weight once `pack()` was called, or from an int8 copy once
    `quantize_int8()` was (int8_linear.py)."""

    packed: torch.Tensor | None = None
    int8: Int8Weight | HeadWeight | RowSplitWeight | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)
        self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def quantize_int8(self, kernel: str) -> None:
        """int8 weights for `kernel` (int8_linear.Int8Weight), or for "fp16" fbgemm's fp16 weights (HeadWeight)."""
        self.int8 = quantized(self.weight, self.bias, kernel)
        self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8(x)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)
