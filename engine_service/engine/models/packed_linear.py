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
"""
import os

import torch
import torch.nn.functional as F
from torch import nn

_PACKABLE = (torch.float32, torch.bfloat16)  # fp16 packing needs AVX512-FP16 / AVX-NE-CONVERT


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in _PACKABLE and torch.backends.mkldnn.is_available()
            and os.environ.get("DECODELAB_CPU_LINEAR", "onednn") != "dense")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense -> oneDNN blocked layout (an opaque mkldnn tensor), tuned for small batches."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


_CHUNK = 256


def bucket_rows(n: int) -> int:
    """The row count a `n`-row input (n <= _CHUNK) is padded to."""
    if n <= 8:
        return n
    step = 8 if n <= 64 else 16
    return -(-n // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n = x.shape[0]
    if n > _CHUNK:
        return torch.cat([packed_linear(part, packed, bias) for part in x.split(_CHUNK)])
    rows = bucket_rows(n)
    if rows != n:
        x = F.pad(x, (0, 0, 0, rows - n))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if rows == n else out[:n]


class Linear(nn.Linear):
    """nn.Linear that runs from a packed weight once `pack()` was called."""

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)
        self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)
