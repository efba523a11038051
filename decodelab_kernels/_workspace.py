import threading

import torch

# Reused gather buffers for the torch paths. Freshly allocating the gathered K/V on every call costs
# more than the gather itself on CPU (page faults on new memory): ~22 ms vs ~3 ms for 48 MB.
# Per thread, so two engines in two threads never share one.
_local = threading.local()


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, name: str) -> torch.Tensor:
    # cache [num_blocks, block_size, Hkv, D], block_ids [n] int64 -> [n, block_size, Hkv, D]
    # valid until this thread's next call with the same name, dtype, device and block shape
    buffers: dict[tuple, torch.Tensor] = _local.__dict__.setdefault("buffers", {})
    n = block_ids.numel()
    # inference tensors can't be written outside inference mode (and vice versa): keep one buffer per mode
    key = (name, cache.dtype, cache.device, cache.shape[1:], torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.shape[0] < n:
        buf = buffers[key] = torch.empty((max(n, 64), *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    return torch.index_select(cache, 0, block_ids, out=buf[:n])


def gather_dequant(cache: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor, name: str,
                   dtype: torch.dtype) -> torch.Tensor:
    # gather_blocks, then for an int8 cache (kv_int8.py) times scale[block, slot, head] into a reused `dtype` buffer;
    # a float cache of another dtype (fp16 under fp32 queries) is converted
    blocks = gather_blocks(cache, block_ids, name)
    if scale is None:
        return blocks if blocks.dtype == dtype else blocks.to(dtype)
    buffers: dict[tuple, torch.Tensor] = _local.__dict__["buffers"]
    n = block_ids.numel()
    key = (name + "_dq", dtype, cache.device, cache.shape[1:], torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.shape[0] < n:
        buf = buffers[key] = torch.empty((max(n, 64), *cache.shape[1:]), dtype=dtype, device=cache.device)
    return torch.mul(blocks, scale[block_ids][..., None], out=buf[:n])
