import torch
import torch.nn.functional as F

from kernels._workspace import gather_blocks


def prefill_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float) -> torch.Tensor:
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
        k = gather_blocks(k_cache, blocks, "prefill_k").view(nb * bs, hkv, d)[:ctx].transpose(0, 1)
        v = gather_blocks(v_cache, blocks, "prefill_v").view(nb * bs, hkv, d)[:ctx].transpose(0, 1)
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
