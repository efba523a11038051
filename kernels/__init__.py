# Attention / KV-cache kernels: a torch reference (the CPU path) and a Triton kernel per file.
# Never imports engine_service: the engine depends on kernels, not the other way round.
import importlib.util

from kernels.copy_blocks import copy_blocks_torch
from kernels.paged_decode_attention import paged_decode_attention_torch
from kernels.prefill_attention import prefill_attention_torch
from kernels.store_kvcache import store_kvcache_torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


__all__ = [
    "copy_blocks_torch", "paged_decode_attention_torch", "prefill_attention_torch", "store_kvcache_torch",
    "triton_available",
]
