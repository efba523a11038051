# Helpers shared by the kernel tests: a random paged KV cache and a plainly written dense attention.
from dataclasses import dataclass

import torch


@dataclass
class PagedCache:
    k_cache: torch.Tensor        # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # [S, M] int32, unused entries -1
    context_lens: torch.Tensor   # [S] int32

    def dense_kv(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        # walk the block table position by position, exactly as docs/architecture.md states the layout
        bs = self.k_cache.shape[1]
        rows = [int(self.block_tables[s, p // bs]) * bs + p % bs for p in range(int(self.context_lens[s]))]
        flat_k = self.k_cache.reshape(-1, *self.k_cache.shape[2:])
        flat_v = self.v_cache.reshape(-1, *self.v_cache.shape[2:])
        return flat_k[rows], flat_v[rows]


def make_paged_cache(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                     dtype=torch.float32, spare_blocks: int = 3, seed: int = 0) -> PagedCache:
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)  # blocks scattered over the pool, not in order
    tables = torch.full((len(context_lens), max(needed) + 1), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(needed):
        tables[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    return PagedCache(k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
                    scale: float) -> torch.Tensor:
    # q [n, H, D] at the given positions; k, v [ctx, Hkv, D]; query i sees keys 0..positions[i]; float64 loops
    n, h, _ = q.shape
    group = h // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        for head in range(h):
            keys = k[:positions[i] + 1, head // group].double()
            vals = v[:positions[i] + 1, head // group].double()
            weights = torch.softmax(keys @ q[i, head].double() * scale, dim=0)
            out[i, head] = weights @ vals
    return out
