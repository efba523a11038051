import math

import pytest
import torch

from decodelab_kernels.copy_blocks import copy_blocks_torch
from decodelab_kernels.paged_decode_attention import paged_decode_attention_torch
from decodelab_kernels.prefill_attention import prefill_attention_torch
from decodelab_kernels.store_kvcache import store_kvcache_torch
from tests.kernels.kernel_testing import make_paged_cache, naive_attention


def test_store_kvcache_writes_each_row_to_its_slot_and_skips_padding():
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([9, -1, 0, 23, -1])
    store_kvcache_torch(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    for i, slot in [(0, 9), (2, 0), (3, 23)]:
        assert torch.equal(flat_k[slot], key[i]) and torch.equal(flat_v[slot], value[i])
    untouched = [r for r in range(24) if r not in (0, 9, 23)]
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


def test_copy_blocks_copies_every_layer_k_and_v_and_nothing_else():
    kv = torch.randn(3, 2, 7, 4, 2, 8)
    before = kv.clone()
    copy_blocks_torch(kv, torch.tensor([1, 4]), torch.tensor([5, 0]))
    assert torch.equal(kv[:, :, 5], before[:, :, 1]) and torch.equal(kv[:, :, 0], before[:, :, 4])
    for blk in (1, 2, 3, 4, 6):
        assert torch.equal(kv[:, :, blk], before[:, :, blk])


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_torch_matches_naive_attention(heads, kv_heads, block_size):
    lens = [1, 7, 16, 33, 70, 5, 64, 17, 2, 40, 9]  # unsorted, more than one group of 8
    cache = make_paged_cache(lens, block_size, kv_heads, 16)
    q = torch.randn(len(lens), heads, 16)
    scale = 1 / math.sqrt(16)
    out = paged_decode_attention_torch(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                       cache.context_lens, scale)
    for s, n in enumerate(lens):
        k, v = cache.dense_kv(s)
        ref = naive_attention(q[s:s + 1], k, v, [n - 1], scale)
        torch.testing.assert_close(out[s:s + 1].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (9, 3)])
def test_prefill_torch_matches_naive_attention_with_and_without_prefix(heads, kv_heads):
    # (context_len, q_len): a fresh prompt, a chunk after a cached prefix, a single token, a block-aligned chunk
    specs = [(20, 20), (37, 12), (9, 1), (32, 16)]
    cache = make_paged_cache([c for c, _ in specs], 8, kv_heads, 16, seed=1)
    cu = torch.tensor([0] + list(torch.tensor([n for _, n in specs]).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, 16)
    out = prefill_attention_torch(q, cache.k_cache, cache.v_cache, cu, cache.context_lens,
                                  cache.block_tables, 0.3)
    for s, (ctx, q_len) in enumerate(specs):
        k, v = cache.dense_kv(s)
        ref = naive_attention(q[cu[s]:cu[s + 1]], k, v, list(range(ctx - q_len, ctx)), 0.3)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]].double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_torch_handles_half_precision_caches():
    lens = [5, 40]
    cache = make_paged_cache(lens, 16, 2, 16, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 16).to(torch.bfloat16)
    out = paged_decode_attention_torch(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                       cache.context_lens, 0.25)
    assert out.dtype == torch.bfloat16
    for s, n in enumerate(lens):
        k, v = cache.dense_kv(s)
        ref = naive_attention(q[s:s + 1], k, v, [n - 1], 0.25)
        torch.testing.assert_close(out[s:s + 1].double(), ref, atol=2e-2, rtol=2e-2)


def test_decode_reads_back_what_store_wrote_through_the_slot_mapping():
    # the layout contract between the two: slot = block_table[p // bs] * bs + p % bs
    bs, lens, tables = 4, [6, 3], torch.tensor([[5, 1], [2, 0]], dtype=torch.int32)
    k_cache, v_cache = torch.zeros(6, bs, 1, 16), torch.zeros(6, bs, 1, 16)
    slots = torch.tensor([int(tables[s, p // bs]) * bs + p % bs for s, n in enumerate(lens) for p in range(n)])
    key, value = torch.randn(9, 1, 16), torch.randn(9, 1, 16)
    store_kvcache_torch(key, value, k_cache, v_cache, slots)  # no padding: the unmasked path
    q = torch.randn(2, 2, 16)
    out = paged_decode_attention_torch(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.25)
    torch.testing.assert_close(out[0:1].double(), naive_attention(q[0:1], key[:6], value[:6], [5], 0.25),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:2].double(), naive_attention(q[1:2], key[6:], value[6:], [2], 0.25),
                               atol=1e-5, rtol=1e-5)
