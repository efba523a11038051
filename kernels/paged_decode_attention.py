import torch
import torch.nn.functional as F


def _decode_dense(q, k_cache, v_cache, block_tables, context_lens, scale, max_len: int):
    # gather each sequence's blocks into a padded [B, Hkv, L, D] and mask positions >= context_len
    b, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    nb = -(-max_len // bs)
    tables = block_tables[:, :nb].long().clamp_min(0)  # padding entries may be -1; they are masked anyway
    k = k_cache[tables].view(b, nb * bs, hkv, d).transpose(1, 2)
    v = v_cache[tables].view(b, nb * bs, hkv, d).transpose(1, 2)
    mask = torch.arange(nb * bs, device=q.device) < context_lens[:, None]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def paged_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    assert q.shape[1] % k_cache.shape[2] == 0 and q.shape[0] == block_tables.shape[0]
    if q.shape[0] == 0:
        return torch.empty_like(q)
    return _decode_dense(q, k_cache, v_cache, block_tables, context_lens, scale, int(context_lens.max()))
