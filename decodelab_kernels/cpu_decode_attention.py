"""Paged decode attention for x86 CPUs with AVX2 + FMA, or AVX-512 F (`cpu_decode_attention.c`), built on first use.

Why: on the torch path a decode step's attention is, per layer, two gathers of the sequences' blocks into a
padded copy, SDPA with a length mask, and the reshapes around them: ~0.14 ms a layer at batch 1 on the 2-core
AVX2 target, most of it the ops' own overhead for a few hundred context tokens. The C kernel reads K/V in place
through the block table, once per KV head for all its query heads (docs/kernels.md has the measurements).

The engine uses it for fp32 queries over fp32, fp16 or int8 caches on the CPU when it builds (_cbuild.py);
`unavailable()` says why not, and `supports()` whether a given call fits (head size a multiple of 8 up to 256,
at most 16 query heads per KV head). Anything else runs the torch path.

Two builds of the one source (`kernel()` picks): "avx512" (-mavx512f: 16 lanes a register, the scores of 16 tokens
summed as a tree, a token's V row loaded once for up to 4 query heads; head sizes that are not a multiple of 16
take the 8-lane code inside it) where the CPU has AVX-512 F and DECODELAB_CPU_ISA does not narrow it to avx2, else
"avx2". Either gives a sequence the same bits alone or in any batch; the two round differently from each other.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from decodelab_kernels import _cbuild

MAX_D, MAX_G = 256, 16  # as in the C source
# the caches' element kinds, as the C source numbers them, and the stores into float caches
KV_KINDS = {torch.float32: 0, torch.int8: 1, torch.float16: 2}
STORES = {torch.float32: "dl_store_kv", torch.float16: "dl_store_kv_f16"}


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.dl_paged_decode.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, i64, ptr,
                                    i64, ctypes.c_float, ptr]
    lib.dl_paged_decode.restype = None
    lib.dl_store_kv.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.dl_store_kv.restype = None
    lib.dl_store_kv_f16.argtypes = lib.dl_store_kv.argtypes
    lib.dl_store_kv_f16.restype = None


BUILDS = {"avx512": _cbuild.CKernel("cpu_decode_attention", _declare, ("-mavx512f",), ("avx512f",)),
          "avx2": _cbuild.CKernel("cpu_decode_attention", _declare)}


def build_name() -> str:
    """The build the engine uses: "avx512" where it runs and DECODELAB_CPU_ISA allows AVX-512, else "avx2"."""
    return _build_for(_cbuild.cpu_isa())


@functools.cache  # (asked for every layer's call: the build check once per value of the switch)
def _build_for(isa: str) -> str:
    return "avx512" if isa not in ("avx2", "generic") and BUILDS["avx512"].unavailable() is None else "avx2"


def kernel() -> _cbuild.CKernel:
    return BUILDS[build_name()]


def unavailable() -> str | None:
    """None if the kernel runs here, else why not."""
    return kernel().unavailable()


def enabled() -> bool:
    """Whether the engine should use it (it builds, and DECODELAB_CPU_KERNELS is not torch)."""
    return kernel().enabled()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode takes these: fp32 queries on the CPU, an fp32, fp16 or int8 cache, and shapes it
    handles."""
    d, h, hkv = q.shape[-1], q.shape[1], k_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype in KV_KINDS
            and d % 8 == 0 and d <= MAX_D and h % hkv == 0 and h // hkv <= MAX_G)


class DecodeTables:
    """A decode batch's block tables and context lengths, ready for the kernel: made once per engine step and used
    by every layer (the per-call checks and conversions cost as much as the attention of a short context)."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor):
        assert block_tables.shape[0] == len(context_lens)
        self.block_tables = block_tables.to(torch.int32)
        if self.block_tables.stride(1) != 1:
            self.block_tables = self.block_tables.contiguous()
        self.context_lens = context_lens.to(torch.int32).contiguous()
        self._tables = (self.block_tables.data_ptr(), self.block_tables.stride(0), self.context_lens.data_ptr())
        self._lib = kernel().lib

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D] (supports(q, k_cache); heads contiguous) -> [B, H, D]. The caches (and an int8 cache's
        contiguous scales [num_blocks, block_size, Hkv]) as the engine allocates them: contiguous, one dtype."""
        b, h, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty(b, h, d, dtype=torch.float32)
        if b:
            quant = k_scale is not None
            bt, ldbt, lens = self._tables
            self._lib.dl_paged_decode(
                q.data_ptr(), q.stride(0), b, h, k_cache.shape[2], d, k_cache.data_ptr(), v_cache.data_ptr(),
                KV_KINDS[k_cache.dtype], k_scale.data_ptr() if quant else None, v_scale.data_ptr() if quant else None,
                bt, ldbt, lens, k_cache.shape[1], scale, out.data_ptr())
        return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """As kernels.paged_decode_attention_torch: q [B, H, D] -> [B, H, D]; k_scale / v_scale
    [num_blocks, block_size, Hkv] for an int8 cache. Every context length must be >= 1 and every block id it covers
    valid (not checked here)."""
    if (why := unavailable()) is not None:
        raise RuntimeError(f"decodelab_kernels/cpu_decode_attention.c is not available: {why}")
    assert supports(q, k_cache), "see supports()"
    quant = k_cache.dtype == torch.int8
    assert quant == (k_scale is not None) and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert v_cache.dtype == k_cache.dtype and v_cache.shape == k_cache.shape and q.shape[0] == len(context_lens)
    if quant:
        assert k_scale.dtype == v_scale.dtype == torch.float32
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    return DecodeTables(block_tables, context_lens).attend(q, k_cache, v_cache, scale, k_scale, v_scale)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """kernels.store_kvcache_torch for fp32 or fp16 caches (contiguous) and valid slots (int64, contiguous, no -1):
    k, v [N, Hkv, D] fp32, each token's Hkv x D values contiguous (a view of the fused projection is fine); an fp16
    cache takes each value rounded to nearest, as .half() does."""
    n, hkv, d = k.shape
    if n:
        store = getattr(kernel().lib, STORES[k_cache.dtype])
        store(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), n, hkv * d, slots.data_ptr(), k_cache.data_ptr(),
              v_cache.data_ptr())
