import torch


def copy_blocks_torch(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    # kv_cache [L, 2, num_blocks, block_size, Hkv, D]; copies block src[i] -> dst[i] in every layer, K and V
    assert src.shape == dst.shape and src.dim() == 1
    if src.numel() == 0:
        return
    kv_cache[:, :, dst] = kv_cache[:, :, src]  # the gather reads all sources before any write
