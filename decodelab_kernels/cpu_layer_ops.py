"""RMSNorm (with the residual add), RoPE in place, SiLU(gate) * up, and the row scaling around fbgemm's int8
matmul on x86 CPUs with AVX2 + FMA (`cpu_layer_ops.c`), built on first use (decodelab_kernels/_cbuild.py).

Why: between its matmuls a decoder layer runs ~20 small PyTorch ops; at the few rows of a decode step each costs
its own overhead (F.rms_norm ~16 us at one row of 576, RoPE ~16, SiLU * up ~10 on the 2-core AVX2 target), ~8 ms
of a SmolLM2 step. Each op here is one call. The model uses them where `applies()`
(docs/kernels.md has the measurements). RoPE gives the same bits as model.apply_rope; RMSNorm and SiLU differ from
PyTorch's in the last bits (their sums and exp are computed in another order).
"""
from __future__ import annotations

import ctypes

import torch

from decodelab_kernels import _cbuild


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.dl_rms_norm.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.dl_rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]
    lib.dl_silu_mul.argtypes = [ptr, i64, i64, i64, ptr]
    lib.dl_row_absmax_div.argtypes = [ptr, i64, i64, i64, ptr, ptr]
    lib.dl_row_scale.argtypes = [ptr, i64, i64, ptr, ptr]
    for f in (lib.dl_rms_norm, lib.dl_rope, lib.dl_silu_mul, lib.dl_row_absmax_div, lib.dl_row_scale):
        f.restype = None


KERNEL = _cbuild.CKernel("cpu_layer_ops", _declare)
unavailable = KERNEL.unavailable  # None if the kernels run here, else why not
enabled = KERNEL.enabled  # whether the model should use them (they build, and DECODELAB_CPU_KERNELS is not torch)


def applies(x: torch.Tensor) -> bool:
    """Whether the model should run these on x: enabled(), and x is what they take (fp32 rows on the CPU, each
    row contiguous)."""
    return enabled() and x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] (fp32 rows on the CPU, each row contiguous) -> (s, rmsnorm(s) * weight) with s = x + residual,
    or x itself without one. residual [M, N] contiguous fp32; weight [N] contiguous fp32."""
    m, n = x.shape
    y = torch.empty(m, n)
    s = x if residual is None else torch.empty(m, n)
    if m:
        KERNEL.lib.dl_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                                s.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, eps)
    return s, y


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotates the first `heads` heads of each row of x [M, >= heads * head_dim] (fp32 rows, each contiguous) in
    place, as model.apply_rope does: cos / signed_sin contiguous [M, ..., head_dim] fp32, head_dim even."""
    if x.shape[0]:
        KERNEL.lib.dl_rope(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.data_ptr(),
                            signed_sin.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] (fp32 rows, each contiguous; gate then up) -> silu(gate) * up [M, I]."""
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(m, i)
    if m:
        KERNEL.lib.dl_silu_mul(gate_up.data_ptr(), gate_up.stride(0), m, i, y.data_ptr())
    return y


def row_absmax_div(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] (fp32 rows, each contiguous) -> (x / r, r [M, 1]) with r = max(row max |x|, 1e-30): fbgemm's int8
    input on the grid [-1, 1] (int8_linear.py), the same bits as x / x.abs().amax(1, keepdim=True).clamp_min(1e-30)."""
    m, n = x.shape
    xn, r = torch.empty(m, n), torch.empty(m, 1)
    if m:
        KERNEL.lib.dl_row_absmax_div(x.data_ptr(), x.stride(0), m, n, xn.data_ptr(), r.data_ptr())
    return xn, r


def row_scale_(y: torch.Tensor, r: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] contiguous fp32 -> y * r (r [M, 1]) in place, then + bias [N] (contiguous fp32) when given."""
    if y.shape[0]:
        KERNEL.lib.dl_row_scale(y.data_ptr(), y.shape[0], y.shape[1], r.data_ptr(),
                                None if bias is None else bias.data_ptr())
    return y
