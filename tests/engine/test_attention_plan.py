"""The torch backend's per-step plans and KV store (attention.py) give what the kernels give per call, and the
prefill plan what a plainly written attention gives."""
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import decodelab_kernels as kernels
from decodelab_kernels.prefill_attention import PrefillPlan
from engine_service.engine.attention import AttentionMetadata, PagedAttention
from tests.kernels.kernel_testing import make_paged_cache, naive_attention

BLOCK, HKV, D = 8, 2, 16


def step(lens: list[int], heads: int, padding: int, seed: int):
    """A decode-only step: sequence i at context lens[i] (its blocks scattered over the pool), plus `padding`
    rows with slot -1; random q/k/v and caches."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in lens)
    num_blocks = len(lens) * width + 1
    tables = torch.randperm(num_blocks - 1, generator=g)[:len(lens) * width].view(len(lens), width).int()
    slots = [int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lens)] + [-1] * padding
    rows = len(lens) + padding
    tables = torch.cat([tables, torch.zeros(padding, width, dtype=torch.int32)])
    context = torch.tensor(lens + [1] * padding, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode=rows, decode_block_tables=tables,
                             decode_context_lens=context, prefill_cu_seqlens_q=None, prefill_context_lens=None,
                             prefill_block_tables=None)
    q, k, v = (torch.randn(rows, n, D, generator=g) for n in (heads, HKV, HKV))
    caches = [torch.randn(num_blocks, BLOCK, HKV, D, generator=g) for _ in range(2)]
    return q, k, v, caches, meta


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=19), heads=st.sampled_from([2, 6]),
       padding=st.integers(0, 2), seed=st.integers(0, 1000))
@example(lens=[3, 20, 9], heads=6, padding=1, seed=0)  # one group, lengths out of order
@example(lens=[5, 33, 1, 17, 8, 8, 40, 2, 12, 29, 3], heads=2, padding=0, seed=1)  # two groups
def test_planned_decode_and_store_equal_the_kernels(lens, heads, padding, seed):
    q, k, v, (k_cache, v_cache), meta = step(lens, heads, padding, seed)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kernels.store_kvcache_torch(k, v, want_k, want_v, meta.slot_mapping)
    want = kernels.paged_decode_attention_torch(q, want_k, want_v, meta.decode_block_tables,
                                                meta.decode_context_lens, 0.25)
    attn = PagedAttention("torch", 0.25)
    for _ in range(2):  # the second layer reuses the plan the first one made
        got = attn(q, k, v, k_cache, v_cache, meta)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
        torch.testing.assert_close(got, want)  # same math; SDPA may round the last bit differently


@settings(max_examples=25, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(1, 12), st.sampled_from([0, 0, 3, 8, 29])), min_size=1, max_size=4),
       heads=st.sampled_from([2, 6]), seed=st.integers(0, 1000))
@example(chunks=[(5, 95)], heads=6, seed=0)  # a speculative verification: 4 drafts + 1 behind a long context
@example(chunks=[(12, 0), (1, 7), (4, 29)], heads=2, seed=1)  # a fresh prompt, then chunks behind cached ones
def test_a_step_plan_for_its_chunks_matches_naive_attention_in_every_layer(chunks, heads, seed):
    # chunk i: q_len new tokens behind `cached` ones already in the pool (0: a fresh prompt), blocks scattered
    lens = [n + c for n, c in chunks]
    cache = make_paged_cache(lens, BLOCK, HKV, D, seed=seed)
    cu = torch.tensor([0] + [sum(n for n, _ in chunks[:i + 1]) for i in range(len(chunks))], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, D, generator=torch.Generator().manual_seed(seed))
    plan = PrefillPlan.of(cu, cache.context_lens, cache.block_tables, BLOCK)
    for _ in range(2):  # every layer of a step reuses the plan
        got = plan.attend(q, cache.k_cache, cache.v_cache, 0.25)
        for s, (n, cached) in enumerate(chunks):
            k, v = cache.dense_kv(s)
            want = naive_attention(q[cu[s]:cu[s + 1]], k, v, list(range(cached, cached + n)), 0.25)
            torch.testing.assert_close(got[cu[s]:cu[s + 1]].double(), want, atol=1e-5, rtol=1e-5)
