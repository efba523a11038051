# INT8 KV cache (decodelab_kernels/kv_int8.py): the Triton store, decode, prefill and copy kernels vs the torch paths,
# under Triton's interpreter. Run by test_int8_kv.py in a fresh process with TRITON_INTERPRET=1; tiny grids.
import os

import pytest
import torch

from decodelab_kernels.copy_blocks import copy_blocks_torch, copy_blocks_triton
from decodelab_kernels.paged_decode_attention import paged_decode_attention_torch, paged_decode_attention_triton
from decodelab_kernels.prefill_attention import prefill_attention_torch, prefill_attention_triton
from decodelab_kernels.store_kvcache import store_kvcache_torch, store_kvcache_triton
from tests.kernels.kernel_testing import make_paged_cache
from tests.kernels.test_int8_kv import quantized_copy

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_int8_kv.py"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def test_store_triton_writes_what_torch_writes_in_chunks_with_padding():
    qkv = torch.randn(20, 4 + 2 * 2, 16)  # K and V as strided views of a fused qkv
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    key[9:] *= 3.0  # louder rows beside quiet ones in a block: each keeps its own scale
    slots = torch.tensor([8 * 3 + p % 8 if p < 8 else 8 * 1 + p % 8 if p < 16 else 8 * 4 + p % 8 for p in range(20)])
    pools = [[torch.zeros(6, 8, 2, 16, dtype=torch.int8) for _ in range(2)] + [torch.zeros(6, 8, 2) for _ in range(2)]
             for _ in range(2)]
    for lo, hi in [(0, 5), (5, 6), (6, 20)]:
        s = torch.cat([slots[lo:hi], torch.tensor([-1])])
        k, v = torch.cat([key[lo:hi], key[:1]]), torch.cat([value[lo:hi], value[:1]])
        store_kvcache_torch(k, v, *pools[0][:2], s, *pools[0][2:])
        store_kvcache_triton(k, v, *pools[1][:2], s, *pools[1][2:])
    for want, got in zip(pools[0], pools[1]):
        # same scales (to fp32 rounding); int8 values equal but for .5 ties (torch rounds half to even, the kernel
        # away from 0)
        if want.dtype == torch.int8:
            assert (want.float() - got.float()).abs().max() <= 1
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert pools[1][0].abs().sum() > 0


def test_copy_blocks_triton_copies_scales():
    kv = torch.randint(-127, 128, (2, 2, 6, 8, 2, 16), dtype=torch.int8)
    scales = torch.rand(2, 2, 6, 8, 2)
    want_kv, want_scales = kv.clone(), scales.clone()
    src, dst = torch.tensor([0, 3]), torch.tensor([5, 1])
    copy_blocks_torch(want_kv, src, dst, want_scales)
    copy_blocks_triton(kv, src, dst, scales)
    assert torch.equal(kv, want_kv) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,block_size,num_splits", [(2, 8, 1), (6, 16, 2)])
def test_int8_decode_triton_matches_torch(heads, block_size, num_splits, dtype):
    cache = make_paged_cache([1, 70, 16], block_size, 2, 32, seed=block_size)
    (kc, vc), (ks, vs) = quantized_copy(cache)
    q = torch.randn(3, heads, 32).to(dtype)
    args = (cache.block_tables, cache.context_lens, 32 ** -0.5)
    got = paged_decode_attention_triton(q, kc, vc, *args, ks, vs, num_splits=num_splits)
    want = paged_decode_attention_torch(q.float(), kc, vc, *args, ks, vs)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_prefill_triton_matches_torch(dtype):
    cache = make_paged_cache([20, 45], 16, 2, 32, seed=5)
    (kc, vc), (ks, vs) = quantized_copy(cache)
    cu = torch.tensor([0, 20, 33], dtype=torch.int32)
    q = torch.randn(33, 4, 32).to(dtype)
    args = (cu, cache.context_lens, cache.block_tables, 32 ** -0.5)
    got = prefill_attention_triton(q, kc, vc, *args, ks, vs)
    want = prefill_attention_torch(q.float(), kc, vc, *args, ks, vs)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
