import torch

from decodelab_kernels._triton import require_triton, tl, triton

# Precondition for both paths (copy-on-write guarantees it): no dst block is also a src of the same call.


def copy_blocks_torch(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                      kv_scales: torch.Tensor | None = None) -> None:
    # kv_cache [L, 2, num_blocks, block_size, Hkv, D]; copies block src[i] -> dst[i] in every layer, K and V;
    # an int8 cache's scales kv_scales [L, 2, num_blocks, block_size, Hkv] (kv_int8.py) travel with their blocks
    assert src.shape == dst.shape and src.dim() == 1
    if src.numel() == 0:
        return
    kv_cache[:, :, dst] = kv_cache[:, :, src]
    if kv_scales is not None:
        kv_scales[:, :, dst] = kv_scales[:, :, src]


@triton.jit
def _copy_blocks_kernel(kv_ptr, src_ptr, dst_ptr, plane_numel, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr):
    # grid (pairs, layers * 2, chunks): each program copies CHUNK elements of one block in one K or V plane
    pair, plane, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    base = plane.to(tl.int64) * plane_numel
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(kv_ptr + base + src * BLOCK_NUMEL + offs, mask=mask)
    tl.store(kv_ptr + base + dst * BLOCK_NUMEL + offs, x, mask=mask)


def copy_blocks_triton(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                       kv_scales: torch.Tensor | None = None) -> None:
    require_triton()
    assert src.shape == dst.shape and src.dim() == 1 and kv_cache.is_contiguous()
    assert src.dtype == dst.dtype == torch.int64, "int64 keeps block * block_numel from overflowing"
    if src.numel() == 0:
        return
    layers, two, num_blocks = kv_cache.shape[:3]
    block_numel = kv_cache[0, 0, 0].numel()
    chunk = min(1024, triton.next_power_of_2(block_numel))
    grid = (src.numel(), layers * two, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](kv_cache, src, dst, num_blocks * block_numel, BLOCK_NUMEL=block_numel, CHUNK=chunk)
    if kv_scales is not None:  # [L, 2, num_blocks, block_size, Hkv]: the same copy, block_size * Hkv per block
        copy_blocks_triton(kv_scales, src, dst)
