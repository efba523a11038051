import torch
import torch.nn.functional as F

from decodelab_kernels._triton import dot_upcast, load_kv_tile, require_triton, tl, triton
from decodelab_kernels._workspace import gather_dequant

# Sequences are sorted by context length and attended in padded groups of this many. Measured on
# 128 sequences with contexts 16..1000: one padded batch 117 ms/layer, groups of 8 ~14 ms (1 thread).
_GROUP = 8


def _decode_group(q, k_cache, v_cache, block_tables, context_lens, scale, max_len: int, k_scale, v_scale):
    # gather the group's blocks into a padded [b, Hkv, L, D] and mask positions >= context_len
    b, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    nb = -(-max_len // bs)
    ids = block_tables[:, :nb].long().clamp_min(0).reshape(-1)  # unused entries (-1) read block 0, masked
    k = gather_dequant(k_cache, k_scale, ids, "decode_k", q.dtype).view(b, nb * bs, hkv, d).transpose(1, 2)
    v = gather_dequant(v_cache, v_scale, ids, "decode_v", q.dtype).view(b, nb * bs, hkv, d).transpose(1, 2)
    mask = torch.arange(nb * bs, device=q.device) < context_lens[:, None]
    # GQA as G queries per KV head: faster on CPU than SDPA's enable_gqa (which expands K/V)
    out = F.scaled_dot_product_attention(q.view(b, hkv, h // hkv, d), k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale)
    return out.reshape(b, h, d)


def paged_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                 k_scale: torch.Tensor | None = None,
                                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    # k_scale / v_scale [num_blocks, block_size, Hkv]: the scales of int8 caches (kv_int8.py), None for float caches
    assert q.shape[1] % k_cache.shape[2] == 0 and q.shape[0] == block_tables.shape[0] == context_lens.shape[0]
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    lens, order = context_lens.sort(descending=True)
    host_lens = lens.tolist()  # one host sync for all groups
    assert host_lens[-1] >= 1, "a decode query sees at least itself"
    for i, max_len in enumerate(host_lens[::_GROUP]):
        idx = order[i * _GROUP:(i + 1) * _GROUP]
        out[idx] = _decode_group(q[idx], k_cache, v_cache, block_tables[idx], lens[i * _GROUP:(i + 1) * _GROUP],
                                 scale, max_len, k_scale, v_scale)
    return out


# ---- Triton: split-K (flash-decoding). Phase 1 writes one unnormalised partial per (seq, head, split);
# phase 2 merges the splits of each (seq, head) with their log-sum-exp weights.
_BLOCK_N = 64          # context tokens per inner iteration (tl.dot needs >= 16)
_MIN_SPLIT_TOKENS = 128
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, qk_scale,
                         stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
                         num_heads, num_splits, split_len,
                         G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                         QUANT: tl.constexpr, HKV: tl.constexpr):
    # grid (B, Hkv, splits): the G query heads sharing a KV head are one tl.dot tile, so K/V are read once
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    qmask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        k, v = load_kv_tile(k_ptr, v_ptr, bt_ptr + b * stride_btb, t, tmask, kvh, d, D,
                            stride_kb, stride_kt, stride_kh, PAGE, UPCAST, ks_ptr, vs_ptr, HKV, QUANT, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    # an empty split (start >= ctx) stores m = -inf, l = 0, acc = 0: weight 0 in the merge
    part = (b * num_heads + heads) * num_splits + split
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=qmask)
    tl.store(m_ptr + part, m_i, mask=g < G)
    tl.store(l_ptr + part, l_i, mask=g < G)


@triton.jit
def _decode_reduce_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh, num_heads, num_splits,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # grid (B, H)
    b, h = tl.program_id(0), tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < num_splits
    part = (b * num_heads + h) * num_splits + sp
    m = tl.load(m_ptr + part, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # split 0 is never empty (context_len >= 1), so the max is finite
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def _pick_splits(q: torch.Tensor, num_kv_heads: int, max_ctx: int) -> int:
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    wanted = triton.cdiv(2 * sms, q.shape[0] * num_kv_heads)  # ~2 programs per SM
    return max(1, min(wanted, triton.cdiv(max_ctx, _MIN_SPLIT_TOKENS)))


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                                  *, num_splits: int | None = None) -> torch.Tensor:
    require_triton()
    b, h, d = q.shape
    _, page, hkv, _ = k_cache.shape
    assert h % hkv == 0 and k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    quant = k_cache.dtype == torch.int8  # int8 K/V are scaled in the kernel, then cast to q's dtype
    assert quant == (k_scale is not None) and (not quant or k_scale.is_contiguous() and v_scale.is_contiguous())
    assert (quant or q.dtype == k_cache.dtype == v_cache.dtype) and d >= 16, "tl.dot needs one dtype and K >= 16"
    assert block_tables.shape[0] == context_lens.shape[0] == b and block_tables.stride(1) == 1
    out = torch.empty_like(q)
    if b == 0:
        return out
    max_ctx = block_tables.shape[1] * page  # an upper bound that needs no host sync
    splits = num_splits or _pick_splits(q, hkv, max_ctx)
    split_len = triton.cdiv(triton.cdiv(max_ctx, splits), _BLOCK_N) * _BLOCK_N
    splits = triton.cdiv(max_ctx, split_len)
    acc = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    m = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    g = h // hkv
    _decode_split_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache,
        block_tables, context_lens, acc, m, l, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        h, splits, split_len, G=g, D=d, PAGE=page, BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_N=_BLOCK_N, UPCAST=dot_upcast(q.dtype), QUANT=quant, HKV=hkv)
    _decode_reduce_kernel[(b, h)](acc, m, l, out, out.stride(0), out.stride(1), h, splits,
                                  D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=triton.next_power_of_2(splits))
    return out
