# Attention / KV-cache kernels: a torch reference (the CPU path) and a Triton kernel per file.
# Never imports engine_service: the engine depends on kernels, not the other way round.
from decodelab_kernels._triton import HAS_TRITON
from decodelab_kernels.copy_blocks import copy_blocks_torch, copy_blocks_triton
from decodelab_kernels.paged_decode_attention import paged_decode_attention_torch, paged_decode_attention_triton
from decodelab_kernels.prefill_attention import prefill_attention_torch, prefill_attention_triton
from decodelab_kernels.store_kvcache import store_kvcache_torch, store_kvcache_triton


def triton_available() -> bool:
    return HAS_TRITON


__all__ = [
    "copy_blocks_torch", "copy_blocks_triton", "paged_decode_attention_torch", "paged_decode_attention_triton",
    "prefill_attention_torch", "prefill_attention_triton", "store_kvcache_torch", "store_kvcache_triton",
    "triton_available",
]
