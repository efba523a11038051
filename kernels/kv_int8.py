"""INT8 KV cache: int8 K/V values with one fp32 scale per (block, KV head), for K and V separately.

Layout. The caches keep their shape `[num_blocks, block_size, Hkv, D]` with dtype int8; beside each one a
scale tensor `[num_blocks, Hkv]` fp32 (the engine allocates them for all layers as
`kv_scales[L, 2, num_blocks, Hkv]`, so a block's scales travel with it in copy_blocks). A value reads
back as `q * scale[block, head]`, symmetric, q in [-127, 127].

Why per (block, head). A K head's magnitude is set by a few fixed outlier channels, so tokens of one
block share a range and one scale per 16 x D values costs 4 bytes per 1 KiB (~4x the tokens of an fp32
pool; 3.98x at block_size 16, D 64). A scale per token would cost 6% more memory and still be needed
only when one token is far larger than its block's others.

How a block that fills token by token keeps one scale (update_block_scales, used by both store paths):
- a write to a block's slot 0 starts the block afresh: its scale is the max |x| of this step's rows in
  it (the block's earlier contents belong to a previous owner or to rolled-back tokens, never read);
- a later write whose max |x| exceeds `scale * 127` grows the scale to `max(needed, 2 * old)` and
  re-quantizes the rows already in the block (read int8 with the old scale, round with the new one).
The doubling bounds the error: each re-quantization adds at most half a step of its (at least twice
larger) new scale, so every value reads back within one int8 step of the block's final scale
(0.5 + 0.25 + ... < 1), however many times the block grew. Blocks written whole by a prefill get the
exact max; blocks filled by decode lose at most one bit to the doubling.

Cost: the update is ~15 small torch ops per cache and layer over the step's touched blocks, plus host syncs
(torch.unique in BlockWrites, which the engine makes once per step, and the re-quantization check), which
is why the engine captures no CUDA graphs with an int8 KV cache.
"""
from dataclasses import dataclass

import torch

QMAX = 127.0
GROWTH = 2.0  # a scale that grows at least doubles: the re-quantization error stays under one step
_TINY = 1e-12  # an all-zero block still gets a positive scale (x / scale must not be 0 / 0)


def quantize_rows(x: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    # x [N, Hkv, D] float, row_scale [N, Hkv] -> int8
    return (x.float() / row_scale[..., None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)


@dataclass
class BlockWrites:
    """The blocks a step's rows write to: the same for every layer, K and V, so the engine makes it once per step."""

    touched: torch.Tensor  # [U] block ids, each once
    inv: torch.Tensor | None  # [N] row -> its index in touched; None: one row per block, in row order (decode)
    fresh: torch.Tensor  # [U, 1] bool: the step writes the block's slot 0 (the block starts over)

    @classmethod
    def of(cls, slots: torch.Tensor, block_size: int) -> "BlockWrites":
        assert bool(slots.min() >= 0), "padding rows (slot -1) are removed first"
        blocks = slots // block_size
        touched, inv = torch.unique(blocks, return_inverse=True)
        if touched.numel() == blocks.numel():
            return cls(blocks, None, (slots % block_size == 0)[:, None])
        fresh = torch.zeros(touched.numel(), 1, dtype=torch.bool, device=slots.device)
        fresh[inv[slots % block_size == 0]] = True
        return cls(touched, inv, fresh)


def update_block_scales(x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor,
                        writes: BlockWrites | None = None) -> torch.Tensor:
    """Makes `scale` [num_blocks, Hkv] cover the rows `x` [N, Hkv, D] about to be written to `slots` [N]
    (all >= 0) of the int8 `cache`, re-quantizing the kept rows of blocks whose scale grows. Returns the
    scale [N, Hkv] each row is to be quantized with."""
    assert cache.dtype == torch.int8 and scale.dtype == torch.float32
    w = writes or BlockWrites.of(slots, cache.shape[1])
    absmax = x.abs().amax(-1).float()  # [N, Hkv]
    new_max = absmax if w.inv is None else torch.zeros(w.touched.numel(), absmax.shape[1], device=x.device) \
        .scatter_reduce_(0, w.inv[:, None].expand_as(absmax), absmax, "amax")
    old = scale[w.touched].masked_fill_(w.fresh, 0.0)
    old_max = old * QMAX
    grow = new_max > old_max
    new = torch.where(grow, torch.maximum(new_max, old_max * GROWTH), old_max).clamp_min_(_TINY).div_(QMAX)
    regrown = (grow & (old > 0)).any(1)  # blocks with rows to re-quantize
    if bool(regrown.any()):
        ids = w.touched[regrown]
        ratio = (old / new)[regrown][:, None, :, None]
        cache[ids] = (cache[ids].float() * ratio).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    scale[w.touched] = new
    return new if w.inv is None else new[w.inv]


def store_int8_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor,
                     writes: BlockWrites | None = None) -> None:
    # store_kvcache for int8 caches, on rows already stripped of padding (slots >= 0)
    hkv, d = key.shape[1:]
    writes = writes or BlockWrites.of(slots, k_cache.shape[1])
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        row_scale = update_block_scales(x, slots, cache, scale, writes)
        cache.view(-1, hkv, d).index_copy_(0, slots, quantize_rows(x, row_scale))


def dequantize(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # cache [n, block_size, Hkv, D] int8, scale [n, Hkv] -> dtype (a plain reference; the paths use workspace buffers)
    return (cache.float() * scale[:, None, :, None]).to(dtype)
