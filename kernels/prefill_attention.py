import torch
import torch.nn.functional as F

from kernels._triton import dot_upcast, load_kv_tile, require_triton, tl, triton
from kernels._workspace import gather_dequant


def prefill_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    # k_scale / v_scale [num_blocks, Hkv]: the scales of int8 caches (kv_int8.py), None for float caches
    # few sequences per step: loop, gather each one's cached K/V, SDPA with a causal-with-offset mask
    out = torch.empty_like(q)
    bs, hkv, d = k_cache.shape[1:]
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for s, ctx in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        assert ctx >= q_len, "the new tokens are part of the context"
        nb = -(-ctx // bs)
        blocks = block_tables[s, :nb].long()
        k = gather_dequant(k_cache, k_scale, blocks, "prefill_k", q.dtype).view(nb * bs, hkv, d)[:ctx].transpose(0, 1)
        v = gather_dequant(v_cache, v_scale, blocks, "prefill_v", q.dtype).view(nb * bs, hkv, d)[:ctx].transpose(0, 1)
        qs = q[start:end].transpose(0, 1)
        if ctx == q_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # query i sits at position ctx - q_len + i and sees every key position <= that
            pos_q = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos_q[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


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
