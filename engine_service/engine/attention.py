"""Paged attention over the KV pool, dispatched to decodelab_kernels/ (torch reference or Triton).

On the torch backend the decode part of a step runs from a `DecodePlan` and its multi-token chunks from a
`PrefillPlan` (decodelab_kernels/prefill_attention.py, which makes one per call), each worked out once per step rather
than once per layer: kernels.paged_decode_attention_torch sorts the context lengths, cuts length-sorted groups
of 8 and builds their block ids and length masks on every call, which at batch 1 cost ~0.2 ms of a layer's
0.28 ms (SmolLM2 shapes, one core of the 2-core target); the plan leaves the gathers and SDPA per layer (same
groups, same math as the kernel; tests/engine/test_attention_plan.py compares them). The KV store skips its
padding check per layer the same way.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import decodelab_kernels as kernels
from decodelab_kernels import cpu_decode_attention
from decodelab_kernels._workspace import gather_dequant
from decodelab_kernels.kv_int8 import store_int8_torch
from decodelab_kernels.prefill_attention import PrefillPlan

_GROUP = 8  # sequences per padded decode group, as in decodelab_kernels/paged_decode_attention.py (see docs/kernels.md)


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # int64 rows of the decode batch (None: all of them, in order)
    block_ids: torch.Tensor  # [size * num_blocks] int64, the blocks to gather (padding entries read block 0)
    num_blocks: int
    mask: torch.Tensor  # [size, 1, 1, num_blocks * block_size] bool: position < context length


@dataclass
class DecodePlan:
    groups: list[DecodeGroup]

    @classmethod
    def of(cls, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> "DecodePlan":
        lens, order = context_lens.sort(descending=True)
        host_lens = lens.tolist()  # one host sync per step
        assert host_lens[-1] >= 1, "a decode query sees at least itself"
        single = len(host_lens) <= _GROUP
        groups = []
        for start in range(0, len(host_lens), _GROUP):
            rows = order[start:start + _GROUP]
            num_blocks = -(-host_lens[start] // block_size)
            table = block_tables if single else block_tables[rows]
            positions = torch.arange(num_blocks * block_size, device=block_tables.device)
            group_lens = context_lens if single else lens[start:start + _GROUP]
            groups.append(DecodeGroup(None if single else rows, table[:, :num_blocks].long().clamp_min(0).reshape(-1),
                                      num_blocks, (positions < group_lens[:, None])[:, None, None, :]))
        return cls(groups)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        # k_scale / v_scale: an int8 cache's [num_blocks, block_size, Hkv] scales (decodelab_kernels/kv_int8.py):
        # gather, then dequantize
        b, h, d = q.shape
        bs, hkv = k_cache.shape[1], k_cache.shape[2]
        out = None if self.groups[0].rows is None else torch.empty_like(q)
        for g in self.groups:
            qg = q if g.rows is None else q[g.rows]
            n, length = qg.shape[0], g.num_blocks * bs
            k = gather_dequant(k_cache, k_scale, g.block_ids, "decode_k", q.dtype).view(n, length, hkv, d)
            v = gather_dequant(v_cache, v_scale, g.block_ids, "decode_v", q.dtype).view(n, length, hkv, d)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            # GQA as G queries per KV head: faster on CPU than SDPA's enable_gqa (docs/kernels.md)
            o = F.scaled_dot_product_attention(qg.view(n, hkv, h // hkv, d), k, v, attn_mask=g.mask, scale=scale)
            if g.rows is None:
                return o.reshape(b, h, d)
            out[g.rows] = o.reshape(n, h, d)
        return out


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
    # the first num_generated tokens are generated ones (decoding, verification), the rest prompt tokens (CPU;
    # ModelRunner.prepare; read by int8_linear.RowSplitWeight)
    num_generated: int = 0
    # the torch backend's per-step work, made by the first layer and reused by the others
    _decode_plan: DecodePlan | None = field(default=None, repr=False, compare=False)
    _decode_tables: cpu_decode_attention.DecodeTables | None = field(default=None, repr=False, compare=False)
    _prefill_plan: PrefillPlan | None = field(default=None, repr=False, compare=False)
    _store_slots: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _store_rows: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def decode_plan(self, block_size: int) -> DecodePlan:
        if self._decode_plan is None:
            self._decode_plan = DecodePlan.of(self.decode_block_tables, self.decode_context_lens, block_size)
        return self._decode_plan

    def decode_tables(self) -> cpu_decode_attention.DecodeTables:
        if self._decode_tables is None:
            self._decode_tables = cpu_decode_attention.DecodeTables(self.decode_block_tables, self.decode_context_lens)
        return self._decode_tables

    def prefill_plan(self, block_size: int) -> PrefillPlan:
        if self._prefill_plan is None:
            self._prefill_plan = PrefillPlan.of(self.prefill_cu_seqlens_q, self.prefill_context_lens,
                                                self.prefill_block_tables, block_size)
        return self._prefill_plan

    def store_slots(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The slots to write and the rows they take (None: every row; slot -1 is padding, skipped)."""
        if self._store_slots is None:
            valid = self.slot_mapping >= 0
            if bool(valid.all()):
                self._store_slots = self.slot_mapping
            else:
                self._store_rows = valid.nonzero().flatten()
                self._store_slots = self.slot_mapping[self._store_rows]
        return self._store_slots, self._store_rows


class PagedAttention:
    def __init__(self, backend: str, scale: float):
        suffix = "_triton" if backend == "triton" else "_torch"
        if backend == "triton" and not kernels.triton_available():
            raise RuntimeError("attention_backend='triton' needs the triton package: pip install 'decodelab[triton]'")
        self.torch_backend = backend != "triton"
        self.store = getattr(kernels, "store_kvcache" + suffix)
        self.decode = getattr(kernels, "paged_decode_attention" + suffix)
        self.prefill = getattr(kernels, "prefill_attention" + suffix)
        self.scale = scale
        # an int8 KV cache's scales [num_blocks, Hkv], bound by the model runner beside the caches
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # decode and the KV store through decodelab_kernels/cpu_decode_attention.c (decided on first use: the model's
        # dtypes and layouts do not change between steps)
        self._cpu_decode: bool | None = None
        self._cpu_store: bool | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.torch_backend:
            _store(k, v, k_cache, v_cache, meta, self.k_scale, self.v_scale, self._use_cpu_store(k, v, k_cache))
        else:
            self.store(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        nd = meta.num_decode
        parts = []
        if nd:
            if self.torch_backend and self._use_cpu_decode(q, k_cache):
                parts.append(meta.decode_tables().attend(q[:nd], k_cache, v_cache, self.scale, self.k_scale,
                                                         self.v_scale))
            elif self.torch_backend:
                parts.append(meta.decode_plan(k_cache.shape[1]).attend(q[:nd], k_cache, v_cache, self.scale,
                                                                       self.k_scale, self.v_scale))
            else:
                parts.append(self.decode(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                         meta.decode_context_lens, self.scale, self.k_scale, self.v_scale))
        if nd < q.shape[0] and self.torch_backend:
            plan = meta.prefill_plan(k_cache.shape[1])
            parts.append(plan.attend(q[nd:], k_cache, v_cache, self.scale, self.k_scale, self.v_scale))
        elif nd < q.shape[0]:
            parts.append(self.prefill(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens_q,
                                      meta.prefill_context_lens, meta.prefill_block_tables, self.scale,
                                      self.k_scale, self.v_scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _use_cpu_store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if self._cpu_store is None:
            self._cpu_store = (cpu_decode_attention.enabled() and k.is_cpu and self.k_scale is None
                               and k.dtype == v.dtype == torch.float32
                               and k_cache.dtype in cpu_decode_attention.STORES
                               and (k_cache.dtype == torch.float32 or k.shape[-1] % 8 == 0)  # (fp16: 8 values a step)
                               and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v)))
        return self._cpu_store

    def _use_cpu_decode(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if self._cpu_decode is None:
            self._cpu_decode = cpu_decode_attention.enabled() and cpu_decode_attention.supports(q, k_cache)
        return self._cpu_decode


def _store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
           c_store: bool = False) -> None:
    # kernels.store_kvcache_torch with the padding check done once per step (meta.store_slots); c_store: fp32 rows
    # into an fp32 or fp16 cache through cpu_decode_attention.store_kv (PagedAttention._use_cpu_store)
    slots, rows = meta.store_slots()
    if rows is not None:
        k, v = k[rows], v[rows]
    if k_scale is not None:
        if slots.numel():
            store_int8_torch(k, v, k_cache, v_cache, k_scale, v_scale, slots)
        return
    hkv, d = k.shape[1:]
    if c_store:
        cpu_decode_attention.store_kv(k, v, k_cache, v_cache, slots)
        return
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))
