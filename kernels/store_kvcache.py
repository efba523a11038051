import torch

from kernels._triton import require_triton, tl, triton


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


@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kn, stride_kh, stride_vn, stride_vh,
                          HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per new token: copies its [Hkv, D] K and V rows to cache row `slot`
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    k = tl.load(key_ptr + i * stride_kn + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + i * stride_vn + h * stride_vh + d, mask=mask)
    dst = slot.to(tl.int64) * (HKV * D) + h * D + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    require_triton()
    n, hkv, d = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (n,)
    assert key.stride(2) == 1 and value.stride(2) == 1, "rows may be strided (a view of qkv), not the head dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (hkv, d)
    if n == 0:
        return
    _store_kvcache_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping,
                                key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                HKV=hkv, D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d))
