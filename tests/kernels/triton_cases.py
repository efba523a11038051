# Triton kernels vs the torch references on CPU tensors, under Triton's interpreter. Not collected by
# itself: test_triton_kernels.py runs this file in a fresh process with TRITON_INTERPRET=1, which must be
# set before triton is first imported. Grids stay tiny: the interpreter costs ~1 ms per program instance.
import os

import pytest
import torch

from decodelab_kernels.copy_blocks import copy_blocks_torch, copy_blocks_triton
from decodelab_kernels.paged_decode_attention import paged_decode_attention_torch, paged_decode_attention_triton
from decodelab_kernels.prefill_attention import prefill_attention_torch, prefill_attention_triton
from decodelab_kernels.store_kvcache import store_kvcache_torch, store_kvcache_triton
from tests.kernels.kernel_testing import make_paged_cache

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_triton_kernels.py"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _reference(fn, *args):
    # the torch reference in fp32 on the same (rounded) inputs
    return fn(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kvcache_triton_matches_torch_with_padding_and_strided_rows(dtype):
    qkv = torch.randn(6, 4 + 2 * 2, 16).to(dtype)  # K and V as views into a fused qkv projection
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, -1, 17, 0, -1, 30])
    caches = [torch.zeros(4, 8, 2, 16, dtype=dtype) for _ in range(4)]
    store_kvcache_torch(key, value, caches[0], caches[1], slots)
    store_kvcache_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2].abs().sum() > 0


def test_copy_blocks_triton_matches_torch():
    kv = torch.randn(2, 2, 6, 8, 2, 16)
    expected = kv.clone()
    src, dst = torch.tensor([0, 3, 3]), torch.tensor([5, 1, 2])
    copy_blocks_torch(expected, src, dst)
    copy_blocks_triton(kv, src, dst)
    assert torch.equal(kv, expected)


DECODE_CASES = [  # (heads, kv_heads, head_dim, block_size, num_splits)
    (2, 2, 16, 8, 1), (6, 2, 16, 16, 3), (8, 2, 16, 8, 2),
    (2, 2, 64, 16, 2), (6, 2, 64, 8, 1), (8, 2, 64, 16, 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,num_splits", DECODE_CASES)
def test_decode_triton_matches_torch(heads, kv_heads, head_dim, block_size, num_splits, dtype):
    lens = [1, 70, 16, 150]  # ragged; 150 spans three 64-token splits, 1 leaves later splits empty
    cache = make_paged_cache(lens, block_size, kv_heads, head_dim, dtype=dtype, seed=head_dim + block_size)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, head_dim ** -0.5)
    out = paged_decode_attention_triton(*args, num_splits=num_splits)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(paged_decode_attention_torch, *args),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_triton_bf16_matches_torch():
    lens = [33, 5, 90]
    cache = make_paged_cache(lens, 16, 1, 64, dtype=torch.bfloat16)
    q = torch.randn(3, 4, 64).to(torch.bfloat16)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    out = paged_decode_attention_triton(*args, num_splits=2)
    torch.testing.assert_close(out.float(), _reference(paged_decode_attention_torch, *args), atol=2e-2, rtol=2e-2)


PREFILL_CASES = [  # (heads, kv_heads, head_dim, block_size)
    (2, 2, 16, 8), (6, 2, 16, 16), (8, 2, 64, 8), (3, 3, 64, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", PREFILL_CASES)
def test_prefill_triton_matches_torch(heads, kv_heads, head_dim, block_size, dtype):
    # (context_len, q_len): fresh prompt longer than one 64-query tile, chunk after a prefix, one token
    specs = [(70, 70), (45, 20), (9, 1)]
    cache = make_paged_cache([c for c, _ in specs], block_size, kv_heads, head_dim, dtype=dtype, seed=3)
    cu = torch.tensor([0, 70, 90, 91], dtype=torch.int32)
    q = torch.randn(91, heads, head_dim).to(dtype)
    args = (q, cache.k_cache, cache.v_cache, cu, cache.context_lens, cache.block_tables, head_dim ** -0.5)
    out = prefill_attention_triton(*args)
    torch.testing.assert_close(out.float(), _reference(prefill_attention_torch, *args),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_prefill_triton_bf16_matches_torch():
    cache = make_paged_cache([24], 8, 2, 16, dtype=torch.bfloat16)
    q = torch.randn(10, 4, 16).to(torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    args = (q, cache.k_cache, cache.v_cache, cu, cache.context_lens, cache.block_tables, 0.25)
    torch.testing.assert_close(prefill_attention_triton(*args).float(), _reference(prefill_attention_torch, *args),
                               atol=2e-2, rtol=2e-2)
