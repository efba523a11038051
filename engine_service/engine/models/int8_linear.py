"""INT8 linears: 8-bit weights, activations quantized at run time.

Our kernel's builds and two of PyTorch's; `int8_kernel` picks one:

- "amx" (x86 CPUs with AMX-INT8, Intel Xeons since Sapphire Rapids: the CPU default there; the VNNI build with its
  blocks of 16 rows or more through the tiles, the same bits), "avx512vnni" (x86 CPUs with AVX512-VNNI and a C
  compiler: the default there, and DECODELAB_INT8_KERNEL=avx512vnni turns AMX off), "avx512" (AVX-512 F + BW
  without VNNI: the default there; DECODELAB_INT8_KERNEL=amx, =avx512vnni or =avx512 insists on one) and "avx2" (x86
  CPUs with AVX2: the default elsewhere, and DECODELAB_CPU_ISA=avx2 or DECODELAB_INT8_KERNEL=avx2 on any): the
  builds of our own kernel (decodelab_kernels/cpu_int8_vnni.c, cpu_int8_avx512.c and cpu_int8.c, the same weight format
  and the same integer products, built on first use) for every matmul and the LM head, prompt and generated rows alike,
  each row batch-invariant (outputs in a register's lanes: decodelab_kernels/cpu_int8.py `pack_wide`). Weights are 8-bit
  codes in groups of 32 along K, each group with its own fp32 step and offset (decodelab_kernels/cpu_int8.py
  `GroupedInt8`, `quantize`: a group's 256 levels span its own [min, max]; a weight whose codes are all on a 16-level
  grid, as a Q4_1 GGUF's are, is held as 4-bit codes: `Matrix.nibbles`); activations are quantized per row to int16
  inside the call; products and a group's sums are integers (vpmaddwd), nothing is calibrated, and each row's result is
  independent of the others of its step. Measured on SmolLM2-135M (docs/kernels.md, `decodelab bench quality`): the
  fbgemm mix below, the default before, moved continuation log-likelihoods by up to 0.80 nats and perplexity by up to
  +3.0% (its 8-bit prompt activations and per-row weight scales both cost); this kernel 0.022 nats and at most +0.09%.
  The price is prefill speed: the q/k/v and gate/up matmuls of prompt rows ran ~1.5x faster through fbgemm, and the fp32
  step per group costs ~1.3x at 64 rows against per-row scales.
- "fbgemm" (x86 CPUs with AVX2 or better where our kernel does not build, or DECODELAB_INT8_KERNEL=fbgemm; with a C
  compiler it runs only prompt tokens' q/k/v and gate/up, and the avx2 kernel the rest: `projection_kernels`,
  `RowSplitWeight`): weights (per-row scales) and activations in int8 through PyTorch's quantized engine (fbgemm).
  `quantized.linear_prepack` reorders the int8 weight once; each call quantizes its fp32 input to uint8, multiplies
  with int32 accumulation and scales back to fp32. It was the fastest int8 path in PyTorch on the AVX2 target
  (docs/kernels.md has the table: 2.5-3.5x fewer ms than the oneDNN-packed fp32 weights for the linears of a decode
  step; torchao's CPU int8 and `torch._int_mm` were 10-400x slower in eager mode). PyTorch's
  `quantized.linear_dynamic` picks one activation scale for the whole input; three things make this accurate enough
  (SmolLM2-135M, docs/kernels.md; plain linear_dynamic had 3.4x its perplexity):
  * rows are scaled to max |x| = 1 before the call and back after, and quantized on the fixed grid [-1, 1]
    (`quantized.linear_with_input_q_dq_qweight_dq_output_fp32`: linear_dynamic's kernel with the input's
    scale given; bitwise what linear_dynamic gives for an input spanning [-1, 1]): per-token quantization
    (one outlier token no longer flattens the rest of a prefill) and each row's result independent of the
    other rows of its step (batch-invariant: a speculative verification gives what one-token decoding gives);
  * weights use 7 bits (|q| <= 63) and activations 8: without VNNI the AVX2 kernel adds pairs of
    uint8 x int8 products in int16 (vpmaddubsw), which saturates beyond 2 x 255 x 63;
  * SmoothQuant (`smoothing_scales`): activation outlier channels are divided down and the weight columns
    multiplied up by the same factors, folded into the ops before (llama.py), from the input ranges of a
    short built-in text (`CALIBRATION_TEXT`) seen once at load.
  Generated tokens (decoding, verification) run the avx2 kernel for every matmul: no per-call quantization
  overhead at the 1-11 rows of decoding. o_proj, down_proj and the LM head do not quantize their activations to
  8 bits for prompt tokens either: their inputs carry the worst outliers (silu(gate) * up above all; all-int8
  was +2.1% perplexity on held-out text, `decodelab bench quality`). They run the avx2 kernel (int16
  activations: +0.43% perplexity for the whole mix, SmoothQuant only on q/k/v and gate/up), which is also
  faster than the fp16 weights they ran from before (+0.57%; the head at 11 rows 7.1 vs 9.4 ms, down_proj 7.2
  vs 9.3). Without a C compiler, down_proj and the head fall back to fbgemm's fp16 weights (`HeadWeight`) and
  o_proj to fbgemm.
- "dequant" (CUDA, CPUs where neither of the above runs, or DECODELAB_INT8_KERNEL=dequant): weight-only, the avx2
  kernel's grouped 8-bit weights (the same GroupedInt8) dequantized to the input's dtype each call and multiplied by
  F.linear: weight memory ~half (bf16) or ~a quarter (fp32); the matmul runs at the input dtype's speed plus the
  dequantization (a fallback for memory, not speed). Tested on the CPU; not run on a GPU.
"""
import contextlib
import contextvars
import functools
import os
import warnings

import torch
import torch.nn.functional as F

from decodelab_kernels import cpu_int8, cpu_layer_ops
from decodelab_kernels._cbuild import generic_cpu

KERNELS = ("amx", "avx512vnni", "avx512", "avx2", "fbgemm", "dequant")
OURS = ("amx", "avx512vnni", "avx512", "avx2")  # the builds of decodelab_kernels/cpu_int8 (cpu_int8.KERNELS' names)
QMAX = {"avx512": 127, "avx2": 127, "fbgemm": 63, "dequant": 127}

# Seen once at load to find each matmul's activation ranges (SmoothQuant calibration): prose, code, numbers.
CALIBRATION_TEXT = (
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker. Every morning he "
    "opened his shop, wound the clocks and listened to them tick.\n"
    "def add(a, b):\n    return a + b\n"
    "The results of the 2019 survey show that 42% of people prefer tea to coffee, while 3 in 10 drink both."
)


def quantize_weight(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in] in [-qmax, qmax], fp32 scale [out]); an all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / qmax, 1.0)
    q = torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def smoothing_scales(act_amax: torch.Tensor, weight_colmax: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's s_j = max|x_j|^alpha / max|w_j|^(1 - alpha): x_j / s_j and w_j * s_j balance the
    ranges of activation channel j and weight column j (x @ w.T is unchanged)."""
    s = act_amax.float().clamp_min(1e-5) ** alpha / weight_colmax.float().clamp_min(1e-5) ** (1 - alpha)
    return s.clamp(1e-3, 1e3)


def _grid_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x (every |value| <= 1) quantized to uint8 on the grid [-1, 1] (scale 2/255, zero point 128: what dynamic
    quantization picks for min -1, max 1), times the packed int8 weight with int32 sums, back in fp32."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 2 / 255, 128, packed)


@contextlib.contextmanager
def _quantized_engine(name: str):
    # the engine is a process-wide setting read at prepack time; the packed weight keeps its kernel
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor):
    zero_points = torch.zeros(q.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():  # PyTorch 2.13 deprecates quantized tensors (pytorch#184982); torch is pinned
        warnings.filterwarnings("ignore", message="torch.quantize_per_tensor")
        qweight = torch._make_per_channel_quantized_tensor(q.cpu(), scale.double().cpu(), zero_points, 0)
    with _quantized_engine("fbgemm"):
        return torch.ops.quantized.linear_prepack(qweight, None)


@functools.cache
def _fbgemm_error() -> str | None:
    """None if the fbgemm int8 kernels run here, else why not (fbgemm needs x86 with AVX2 at least)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this PyTorch build has no fbgemm quantized engine"
    try:  # fbgemm's own CPU check raises at prepack on a CPU without AVX2
        _grid_linear(torch.ones(1, 8), _fbgemm_pack(*quantize_weight(torch.ones(8, 8))))
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    return None


def int8_kernel(device: torch.device) -> str:
    """Which kernel int8 linears use on `device`: on a CPU our kernel where it builds (cpu_int8.default_isa():
    "amx", "avx512vnni", "avx512" or "avx2"), else "fbgemm" where that runs, else "dequant"; "dequant" on other devices.
    DECODELAB_INT8_KERNEL forces one ("fbgemm": the faster-prefilling mix with 8-bit activations that was the
    default before the grouped weights; tests, A/B runs)."""
    forced = os.environ.get("DECODELAB_INT8_KERNEL", "")
    if forced and forced not in KERNELS:
        raise ValueError(f"DECODELAB_INT8_KERNEL: expected one of {', '.join(KERNELS)}, got {forced!r}")
    if forced == "dequant" or device.type != "cpu":
        return "dequant"
    if forced == "fbgemm":
        if (why := _fbgemm_error()) is not None:
            raise ValueError(f"DECODELAB_INT8_KERNEL: fbgemm does not run on this CPU ({why})")
        return "fbgemm"
    if forced in OURS:
        if (why := cpu_int8.unavailable(forced)) is not None:
            raise ValueError(f"DECODELAB_INT8_KERNEL: {forced} does not run here ({why})")
        return forced
    if cpu_int8.unavailable() is None:
        return cpu_int8.default_isa()
    return "fbgemm" if not generic_cpu() and _fbgemm_error() is None else "dequant"  # fbgemm is x86-only


class HeadWeight:
    """fbgemm's fp16 weights, fp32 activations and accumulation: the LM head of an int8 model on the fbgemm
    kernel, and each layer's down_proj (see CausalLM.quantize_int8)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        b = None if bias is None else bias.detach().float().cpu()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().cpu(), b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        out = torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


# The matmuls of a decoder layer and the LM head, by the names projection_kernels gives them kernels under.
PROJECTIONS = ("qkv", "o", "gate_up", "down", "head")

# How many leading rows of the current forward pass are generated tokens (AttentionMetadata.num_generated; set
# by CausalLM.forward): RowSplitWeight sends those to one kernel and the prompt tokens' rows to another.
generated_rows: contextvars.ContextVar[int] = contextvars.ContextVar("generated_rows", default=0)


def projection_kernels(kernel: str) -> dict[str, str]:
    """The kernel each projection runs on a model quantized for `kernel` ("fp16": HeadWeight; "<isa>|fbgemm":
    RowSplitWeight, its generated rows on our kernel's build for this CPU, cpu_int8.default_isa()). On fbgemm where
    our kernel builds, generated tokens' rows run it everywhere and only the prompt tokens' rows of q/k/v and
    gate/up quantize their activations to int8 through fbgemm; o_proj, down_proj and the head, whose inputs carry
    the outliers int8 activations handle worst, run our kernel (int16 activations) for every row. Without a C
    compiler, down_proj and the head fall back to fbgemm's fp16 weights and o_proj to fbgemm."""
    if kernel != "fbgemm":
        return dict.fromkeys(PROJECTIONS, kernel)
    if cpu_int8.unavailable() is None:
        ours = cpu_int8.default_isa()
        return {"qkv": f"{ours}|fbgemm", "o": ours, "gate_up": f"{ours}|fbgemm", "down": ours, "head": ours}
    return {"qkv": "fbgemm", "o": "fbgemm", "gate_up": "fbgemm", "down": "fp16", "head": "fp16"}


def quantized(weight: torch.Tensor, bias: torch.Tensor | None,
              kernel: str) -> "HeadWeight | Int8Weight | RowSplitWeight":
    """`weight` (and `bias`) as `kernel` multiplies by it: a projection_kernels value."""
    if kernel == "fp16":
        return HeadWeight(weight, bias)
    if kernel.endswith("|fbgemm"):
        return RowSplitWeight(weight, bias)
    return Int8Weight(weight, bias, kernel)


class RowSplitWeight:
    """One weight in both int8 forms: the step's generated tokens (`generated_rows`: decoding, speculative
    verification) through the avx2 kernel, its prompt tokens through fbgemm. Each kernel wins where it runs
    (2-core AVX2 target, docs/kernels.md): avx2 at the 1-11 rows of decoding (no per-call quantization overhead:
    SmolLM2's q/k/v for 30 layers 0.9 vs 2.1 ms at one row), fbgemm's 8-bit activations at the hundreds of rows
    of a prefill (~1.5x). The choice goes by what a token is, not by the size of its step or chunk, so rows stay
    batch-invariant and a prompt gives the same K/V however prefix caching or chunked prefill cut it (a
    preempted sequence's generated tokens, recomputed with its prompt, take fbgemm then). The weight is held
    twice (int8 both times)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.generated = Int8Weight(weight, bias, cpu_int8.default_isa())
        self.prompt = Int8Weight(weight, bias, "fbgemm")
        self.kernel = f"{self.generated.kernel}|fbgemm"
        self.scale, self.out_features = self.generated.scale, weight.shape[0]
        self.group_bytes, self.matrix = self.generated.group_bytes, self.generated.matrix  # what decode rows read

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = generated_rows.get()
        if n >= x.shape[0]:
            return self.generated(x)
        if n == 0:
            return self.prompt(x)
        return torch.cat([self.generated(x[:n]), self.prompt(x[n:])])


class Int8Weight:
    """One [out, in] weight in int8 and how to multiply by it: `w(x)` ~= F.linear(x, weight, bias). On our kernel's
    builds every row, a prompt token's or a generated one's, takes the same blocks (until session 33 the AVX2 and
    AVX-512 builds sent a forward pass's 64 or more prompt rows through a second, many-rows matmul)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str):
        assert kernel in KERNELS, kernel
        self.kernel = kernel
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.packed = self.matrix = self.grouped = None
        self.group_bytes = 0  # beyond one int8 a weight and its scales (`scale`: per row, or per group)
        if kernel == "fbgemm":  # fbgemm keeps its own packed copy of q
            q, self.scale = quantize_weight(weight, QMAX[kernel])
            self.packed = _fbgemm_pack(q, self.scale)
            return
        grouped = cpu_int8.quantize(weight)  # ours, dequant: 8-bit codes in groups of 32 (GroupedInt8)
        self.scale, self.group_bytes = grouped.d, grouped.m.nbytes  # a step and an offset per group
        if kernel in OURS:
            self.matrix = cpu_int8.Matrix(grouped, self.bias, kernel)  # holds the packed copy only
        else:
            self.grouped = grouped

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.matrix is not None:
            out = self.matrix(x.float())
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        if self.kernel == "dequant":  # the weight in x's dtype each call: a memory saving, not a speed-up
            w = self.grouped.dequantize().to(x.dtype)
            return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        x32 = x.float()
        if cpu_layer_ops.applies(x32):  # the same values in two C calls instead of ~6 ops (~20 us less a call here)
            xn, r = cpu_layer_ops.row_absmax_div(x32)
            out = cpu_layer_ops.row_scale_(_grid_linear(xn, self.packed), r, self.bias)
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        # row max |x|; abs().amax is the same value as vector_norm(inf) at 1/3-1/7 of its time for 8 rows
        r = x32.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
        out = _grid_linear(x32 / r, self.packed)
        out = out * r if self.bias is None else torch.addcmul(self.bias, out, r)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
