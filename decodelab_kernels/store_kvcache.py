import torch

from decodelab_kernels._triton import require_triton, tl, triton
from decodelab_kernels.kv_int8 import QMAX, store_int8_torch

# int8 caches (kv_int8.py) take k_scale / v_scale [num_blocks, block_size, Hkv] fp32: each row's scale is written
# here with it.


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    # key/value [N, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot -1 = padding, skipped
    assert key.shape == value.shape and key.shape[0] == slot_mapping.shape[0]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert (k_cache.dtype == torch.int8) == (k_scale is not None), "an int8 cache needs its scales"
    hkv, d = key.shape[1:]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if k_scale is not None:
        if slot_mapping.numel():
            store_int8_torch(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kn, stride_kh, stride_vn, stride_vh, ks_ptr, vs_ptr,
                          HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                          QUANT: tl.constexpr, QMAX_F: tl.constexpr):
    # one program per new token: copies its [Hkv, D] K and V rows to cache row `slot`
    # (QUANT: rounds them to int8, each head with its own scale max |x| / 127, stored beside at slot * Hkv + head)
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    k = tl.load(key_ptr + i * stride_kn + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + i * stride_vn + h * stride_vh + d, mask=mask, other=0.0)
    dst = slot.to(tl.int64) * (HKV * D) + h * D + d
    if QUANT:
        srow = slot.to(tl.int64) * HKV + h
        ks = tl.maximum(tl.max(tl.abs(k.to(tl.float32)), 1, keep_dims=True), 1e-12) / QMAX_F
        vs = tl.maximum(tl.max(tl.abs(v.to(tl.float32)), 1, keep_dims=True), 1e-12) / QMAX_F
        tl.store(ks_ptr + srow, ks, mask=h < HKV)
        tl.store(vs_ptr + srow, vs, mask=h < HKV)
        k = k.to(tl.float32) / ks
        v = v.to(tl.float32) / vs
        # round half away from zero (torch rounds half to even: a tie may differ by one step)
        k = tl.minimum(tl.maximum(tl.where(k >= 0, k + 0.5, k - 0.5), -127.0), 127.0)
        v = tl.minimum(tl.maximum(tl.where(v >= 0, v + 0.5, v - 0.5), -127.0), 127.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    require_triton()
    n, hkv, d = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (n,)
    assert key.stride(2) == 1 and value.stride(2) == 1, "rows may be strided (a view of qkv), not the head dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (hkv, d)
    assert (k_cache.dtype == torch.int8) == (k_scale is not None), "an int8 cache needs its scales"
    if n == 0:
        return
    quant = k_scale is not None
    _store_kvcache_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping,
                                key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                k_scale if quant else k_cache, v_scale if quant else v_cache,
                                HKV=hkv, D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
                                QUANT=quant, QMAX_F=QMAX)
