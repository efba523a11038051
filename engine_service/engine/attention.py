"""Paged attention over the KV pool, dispatched to kernels/ (torch reference or Triton)."""
from dataclasses import dataclass

import torch

import kernels


@dataclass
class AttentionMetadata:
    """Where the step's tokens go. The first `num_decode` tokens are single-query sequences (decode),
    the rest are the multi-token chunks (prefill, chunked prefill, speculative verification)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decode] int32
    prefill_cu_seqlens_q: torch.Tensor | None  # [num_prefill + 1] int32
    prefill_context_lens: torch.Tensor | None  # [num_prefill] int32
    prefill_block_tables: torch.Tensor | None  # [num_prefill, max_blocks] int32


class PagedAttention:
    def __init__(self, backend: str, scale: float):
        suffix = "_triton" if backend == "triton" else "_torch"
        if backend == "triton" and not kernels.triton_available():
            raise RuntimeError("attention_backend='triton' needs the triton package: pip install 'decodelab[triton]'")
        self.store = getattr(kernels, "store_kvcache" + suffix)
        self.decode = getattr(kernels, "paged_decode_attention" + suffix)
        self.prefill = getattr(kernels, "prefill_attention" + suffix)
        self.scale = scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode
        parts = []
        if nd:
            parts.append(self.decode(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                     meta.decode_context_lens, self.scale))
        if nd < q.shape[0]:
            parts.append(self.prefill(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens_q,
                                      meta.prefill_context_lens, meta.prefill_block_tables, self.scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
