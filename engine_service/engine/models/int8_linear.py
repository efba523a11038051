"""INT8 linears: int8 weights with one scale per output channel, activations quantized at run time.

`quantize_weight` is symmetric per output channel: scale = max|w_row| / 127, q = round(w / scale) in
[-127, 127], so y = x @ w.T ~= (x @ q.T) * scale. Two kernels run it (`int8_kernel` picks):

- "fbgemm" (x86 CPUs with AVX2 or better): PyTorch's quantized engine. `quantized.linear_prepack`
  reorders the int8 weight once; `quantized.linear_dynamic` quantizes each input to uint8 (one scale and
  zero point for the whole input, from its min and max), multiplies in int8 with int32 accumulation and
  scales back to fp32 in one call. On this AVX2 CPU (AMD EPYC Zen 3) it beat every alternative (all 121
  matmuls of one SmolLM2 forward; docs/kernels.md has the table): 1.5-3x faster than the oneDNN-packed
  fp32 weights, and torchao's CPU int8 path and `torch._int_mm` were 10-400x slower in eager mode.
  Activations use 7 bits (`reduce_range`): without VNNI the AVX2 kernel sums pairs of uint8 x int8
  products in int16 (vpmaddubsw), which saturates for 8-bit activations; PyTorch's own dynamic
  quantization passes reduce_range=True on x86 for the same reason.
- "dequant" (CUDA, CPUs without fbgemm, or DECODELAB_INT8_KERNEL=dequant): weight-only int8,
  y = F.linear(x, q.to(x.dtype)) * scale. Exact products of the int8 weight with the input, the same on
  every device, and it halves (bf16) or quarters (fp32) weight memory; the matmul itself runs at the
  dtype's speed. The tests run it on the CPU; it has not been run on a GPU.

One activation scale per input means a row's output depends slightly on the other rows of its step
(fp32 results do not): int8 is an approximation, and two runs with different batches may differ in a token.
"""
import contextlib
import functools
import os

import torch
import torch.nn.functional as F

KERNELS = ("fbgemm", "dequant")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], fp32 scale [out]); an all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, 1.0)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@contextlib.contextmanager
def _quantized_engine(name: str):
    # the engine is a process-wide setting read at prepack time; the packed weight keeps its kernel
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    zero_points = torch.zeros(q.shape[0], dtype=torch.int64)
    qweight = torch._make_per_channel_quantized_tensor(q.cpu(), scale.double().cpu(), zero_points, 0)
    with _quantized_engine("fbgemm"):
        return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float().cpu())


@functools.cache
def _fbgemm_error() -> str | None:
    """None if the fbgemm int8 kernels run here, else why not (fbgemm needs x86 with AVX2 at least)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this PyTorch build has no fbgemm quantized engine"
    try:  # fbgemm's own CPU check raises at prepack on a CPU without AVX2
        packed = _fbgemm_pack(*quantize_weight(torch.ones(8, 8)), None)
        torch.ops.quantized.linear_dynamic(torch.ones(1, 8), packed, True)
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    return None


def int8_kernel(device: torch.device) -> str:
    """Which kernel int8 linears use on `device`: "fbgemm" on CPUs that run it, else "dequant".
    DECODELAB_INT8_KERNEL=dequant forces the portable one (tests, A/B runs)."""
    forced = os.environ.get("DECODELAB_INT8_KERNEL", "")
    if forced and forced not in KERNELS:
        raise ValueError(f"DECODELAB_INT8_KERNEL: expected one of {', '.join(KERNELS)}, got {forced!r}")
    if forced == "dequant" or device.type != "cpu":
        return "dequant"
    why = _fbgemm_error()
    if why is not None:
        if forced == "fbgemm":
            raise ValueError(f"DECODELAB_INT8_KERNEL: fbgemm does not run on this CPU ({why})")
        return "dequant"
    return "fbgemm"


class Int8Weight:
    """One [out, in] weight in int8 and how to multiply by it: `w(x, bias)` ~= F.linear(x, weight, bias)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str):
        assert kernel in KERNELS, kernel
        self.kernel = kernel
        self.shape = tuple(weight.shape)
        q, scale = quantize_weight(weight)
        if kernel == "fbgemm":
            self.packed = _fbgemm_pack(q, scale, bias)  # holds its own copies of q, scale and bias
            self.qweight = self.scale = self.bias = None
        else:
            self.packed = None
            self.qweight, self.scale = q, scale
            self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "fbgemm":
            if x.shape[0] == 0:  # fbgemm cannot quantize an empty input (no min / max)
                return x.new_empty(0, self.shape[0])
            out = torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        out = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)
