import torch


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # key/value [N, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot -1 = padding, skipped
    assert key.shape == value.shape and key.shape[0] == slot_mapping.shape[0]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    hkv, d = key.shape[1:]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
