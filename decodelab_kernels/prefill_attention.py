from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decodelab_kernels._triton import dot_upcast, load_kv_tile, require_triton, tl, triton
from decodelab_kernels._workspace import gather_dequant


@dataclass
class PrefillSeq:
    start: int  # its queries are rows start:end of the step's prefill part
    end: int
    context: int  # tokens in its context, the new ones included
    block_ids: torch.Tensor  # [ceil(context / block_size)] int64
    mask: torch.Tensor | None  # [end - start, context] bool; None: causal (the chunk is its whole context)


@dataclass
class PrefillPlan:
    """The multi-token chunks of a step (prefills, chunked prefills, speculative verification) worked out once:
    the lengths read to the host, each chunk's block ids and mask built. The engine makes one per step and reuses
    it in every layer (engine/attention.py): made per call it cost ~80 of ~260 us per layer for a 5-token
    verification at a 100-token context (SmolLM2 shapes, the 2-core AVX2 target).

    Each chunk goes to SDPA as one 4-D batch with enable_gqa: on the CPU that takes PyTorch's flash attention
    kernel (blocked, online softmax, the masked half of a causal prompt skipped), where the 3-D inputs this passed
    before took its math path (the whole score matrix, a softmax over it, a `where` for the mask). Measured on an
    AMD Zen 5, 2 threads, SmolLM2's 9 query and 3 KV heads: a 1000-token prompt 41.5 -> 9.5 ms a layer, 2000
    tokens 171 -> 32; 200 new tokens behind 800 cached 8.6 -> 2.9 ms; a 5-token verification at a 100-token
    context 0.047 -> 0.040 (docs/kernels.md)."""

    seqs: list[PrefillSeq]

    @classmethod
    def of(cls, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
           block_size: int) -> "PrefillPlan":
        cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()  # host syncs, once per step
        seqs = []
        for s, ctx in enumerate(lens):
            start, end = cu[s], cu[s + 1]
            q_len = end - start
            if q_len == 0:
                continue
            assert ctx >= q_len, "the new tokens are part of the context"
            mask = None
            if ctx > q_len:  # query i sits at position ctx - q_len + i and sees every key position <= that
                positions = torch.arange(ctx, device=block_tables.device)
                mask = positions[None, :] <= positions[ctx - q_len:, None]
            seqs.append(PrefillSeq(start, end, ctx, block_tables[s, :-(-ctx // block_size)].long(), mask))
        return cls(seqs)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        h, d = q.shape[1:]
        hkv = k_cache.shape[2]
        for s in self.seqs:
            n = s.block_ids.numel() * k_cache.shape[1]
            k = gather_dequant(k_cache, k_scale, s.block_ids, "prefill_k", q.dtype).view(n, hkv, d)[:s.context]
            v = gather_dequant(v_cache, v_scale, s.block_ids, "prefill_v", q.dtype).view(n, hkv, d)[:s.context]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hkv, context, D]
            qs = q[s.start:s.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=s.mask, is_causal=s.mask is None, scale=scale,
                                               enable_gqa=True)
            out[s.start:s.end] = o[0].transpose(0, 1)
        return out


def prefill_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    # k_scale / v_scale [num_blocks, block_size, Hkv]: the scales of int8 caches (kv_int8.py), None for float caches.
    # Per sequence (few per step): gather its cached K/V, SDPA with a causal-with-offset mask; a plan made for
    # this one call (the engine keeps one per step)
    plan = PrefillPlan.of(cu_seqlens_q, context_lens, block_tables, k_cache.shape[1])
    return plan.attend(q, k_cache, v_cache, scale, k_scale, v_scale)


# ---- Triton: flash attention over the paged cache, one program per (query tile, sequence, query head).
_BLOCK_M = 64  # queries per program
_BLOCK_N = 64  # keys per inner iteration
_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, cu_ptr, lens_ptr, bt_ptr, qk_scale,
                    stride_qn, stride_qh, stride_on, stride_oh, stride_kb, stride_kt, stride_kh, stride_btb, group,
                    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr, HKV: tl.constexpr):
    tile, s, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_ptr + s)
    q_len = tl.load(cu_ptr + s + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(lens_ptr + s)
    kvh = h // group
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qmask = (rows[:, None] < q_len) & (d[None, :] < D)
    pos = ctx - q_len + rows  # absolute position of each query
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qn + h * stride_qh + d[None, :], mask=qmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)  # causal: nothing past the tile's last query
    for t0 in range(0, kv_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < kv_end
        k, v = load_kv_tile(k_ptr, v_ptr, bt_ptr + s * stride_btb, t, tmask, kvh, d, D,
                            stride_kb, stride_kt, stride_kh, PAGE, UPCAST, ks_ptr, vs_ptr, HKV, QUANT, q.dtype)
        sc = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        # key 0 is visible to every query, so each real row has a finite max after the first iteration
        sc = tl.where((t[None, :] <= pos[:, None]) & tmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_on + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qmask)


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    require_triton()
    n, h, d = q.shape
    _, page, hkv, _ = k_cache.shape
    assert h % hkv == 0 and k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    quant = k_cache.dtype == torch.int8  # int8 K/V are scaled in the kernel, then cast to q's dtype
    assert quant == (k_scale is not None) and (not quant or k_scale.is_contiguous() and v_scale.is_contiguous())
    assert (quant or q.dtype == k_cache.dtype == v_cache.dtype) and d >= 16, "tl.dot needs one dtype and K >= 16"
    assert block_tables.stride(1) == 1 and cu_seqlens_q.shape[0] == context_lens.shape[0] + 1
    out = torch.empty_like(q)
    num_seqs = context_lens.shape[0]
    if n == 0 or num_seqs == 0:
        return out
    max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one host sync per call
    grid = (triton.cdiv(max_q, _BLOCK_M), num_seqs, h)
    k_s, v_s = (k_scale, v_scale) if quant else (k_cache, v_cache)  # unused pointers when not quant
    _prefill_kernel[grid](q, k_cache, v_cache, k_s, v_s, out, cu_seqlens_q, context_lens, block_tables, scale * _LOG2E,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
                          k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), h // hkv,
                          D=d, PAGE=page, BLOCK_M=_BLOCK_M, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=_BLOCK_N,
                          UPCAST=dot_upcast(q.dtype), QUANT=quant, HKV=hkv)
    return out
