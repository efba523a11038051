"""decodelab_kernels/cpu_decode_attention.c, our paged decode attention (an AVX2 build and an AVX-512 one), against
plainly written float64 attention over the same paged cache: block sizes, head sizes and query groups off its grids,
contexts across its 64-token chunks, an int8 cache against its dequantized values, an fp16 cache against its values,
a sequence alone or in any batch;
each build where the CPU runs it; and the engine's choice of build (their fall-back: test_cbuild.py)."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from decodelab_kernels import cpu_decode_attention
from decodelab_kernels.kv_int8 import dequantize
from tests.kernels.kernel_testing import make_paged_cache, naive_attention

pytestmark = pytest.mark.skipif(cpu_decode_attention.unavailable() is not None,
                                reason=f"no avx2 decode attention here: {cpu_decode_attention.unavailable()}")


@pytest.fixture(params=["avx512", "avx2"], autouse=True)
def build(request, monkeypatch):
    """Every test runs on each build this CPU runs: DECODELAB_CPU_ISA=avx2 narrows the default to the AVX2 one."""
    if (why := cpu_decode_attention.BUILDS[request.param].unavailable()) is not None:
        pytest.skip(f"no {request.param} decode attention here: {why}")
    monkeypatch.setenv("DECODELAB_CPU_ISA", "avx2" if request.param == "avx2" else "")
    assert cpu_decode_attention.build_name() == request.param
    return request.param


def reference(q, k_cache, v_cache, cache, scale) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(q.shape[0]):
        k, v = cache.__class__(k_cache, v_cache, cache.block_tables, cache.context_lens).dense_kv(s)
        n = int(cache.context_lens[s])
        out[s] = naive_attention(q[s:s + 1], k, v, [n - 1], scale)[0]
    return out


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=5), block_size=st.sampled_from([1, 8, 16, 32]),
       hkv=st.integers(1, 4), group=st.integers(1, 16), d=st.sampled_from([8, 24, 64, 128, 256]),
       seed=st.integers(0, 10_000))
@example(lens=[100, 37, 64, 65, 1, 128], block_size=16, hkv=3, group=3, d=64, seed=0)  # SmolLM2's shapes
@example(lens=[1000], block_size=16, hkv=2, group=7, d=64, seed=1)  # Qwen2-0.5B's group, a long context
def test_matches_float64_attention_and_each_sequence_is_batch_invariant(lens, block_size, hkv, group, d, seed):
    cache = make_paged_cache(lens, block_size, hkv, d, seed=seed)
    q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(seed))
    scale = d ** -0.5
    got = cpu_decode_attention.paged_decode(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                            cache.context_lens, scale)
    assert got.shape == q.shape and got.dtype == torch.float32
    # fp32 dot products over d and an online softmax over the context: a few ulps of the largest terms
    torch.testing.assert_close(got.double(), reference(q, cache.k_cache, cache.v_cache, cache, scale),
                               rtol=1e-5, atol=1e-5)
    for s in range(len(lens)):
        alone = cpu_decode_attention.paged_decode(q[s:s + 1], cache.k_cache, cache.v_cache,
                                                  cache.block_tables[s:s + 1], cache.context_lens[s:s + 1], scale)
        assert torch.equal(alone[0], got[s])


def test_one_sequence_gets_the_same_bits_on_one_thread_or_split_between_two():
    """With the second thread spinning (no OMP_WAIT_POLICY=PASSIVE) even one sequence's tasks (one a KV head) are
    split between the threads: each task's arithmetic is its own, so the bits are those of one thread."""
    cache = make_paged_cache([37], 16, 3, 64, seed=3)  # SmolLM2's shapes, a short context
    q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(3))
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 64 ** -0.5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode_attention.paged_decode(*args)
        torch.set_num_threads(2)
        two = cpu_decode_attention.paged_decode(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one.double(), reference(q, cache.k_cache, cache.v_cache, cache, 64 ** -0.5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16])
def test_an_int8_cache_reads_as_its_dequantized_values(block_size):
    cache = make_paged_cache([1, 37, 90, 150], block_size, 2, 64, seed=block_size)
    g = torch.Generator().manual_seed(3)
    kc = torch.randint(-127, 128, cache.k_cache.shape, dtype=torch.int8, generator=g)
    vc = torch.randint(-127, 128, cache.v_cache.shape, dtype=torch.int8, generator=g)
    ks, vs = (torch.rand(kc.shape[0], block_size, 2, generator=g) * 0.02 + 1e-3 for _ in range(2))
    q = torch.randn(4, 6, 64, generator=g)
    got = cpu_decode_attention.paged_decode(q, kc, vc, cache.block_tables, cache.context_lens, 0.125, ks, vs)
    want = reference(q, dequantize(kc, ks, torch.float64), dequantize(vc, vs, torch.float64), cache, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size,d", [(16, 64), (8, 24), (32, 128)])  # d 24: the 8-lane code in either build
def test_an_fp16_cache_reads_as_its_values_and_each_sequence_is_batch_invariant(block_size, d):
    lens = [1, 37, 64, 65, 150, 300]
    cache = make_paged_cache(lens, block_size, 3, d, seed=d)
    kc, vc = cache.k_cache.half(), cache.v_cache.half()
    q = torch.randn(len(lens), 9, d, generator=torch.Generator().manual_seed(d))
    scale = d ** -0.5
    got = cpu_decode_attention.paged_decode(q, kc, vc, cache.block_tables, cache.context_lens, scale)
    want = reference(q, kc.double(), vc.double(), cache, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for s in range(len(lens)):
        alone = cpu_decode_attention.paged_decode(q[s:s + 1], kc, vc, cache.block_tables[s:s + 1],
                                                  cache.context_lens[s:s + 1], scale)
        assert torch.equal(alone[0], got[s])


def test_queries_as_the_engine_passes_them_a_view_of_the_fused_projection():
    cache = make_paged_cache([20, 70], 16, 3, 64)
    qk = torch.randn(2, 12, 64)  # 9 query heads then 3 key heads, as Attention.forward splits them
    q = qk[:, :9]
    assert not q.is_contiguous()
    tables = cpu_decode_attention.DecodeTables(cache.block_tables, cache.context_lens)
    assert torch.equal(tables.attend(q, cache.k_cache, cache.v_cache, 0.125),
                       tables.attend(q.contiguous(), cache.k_cache, cache.v_cache, 0.125))


def test_supports_says_which_calls_fit():
    cache = torch.zeros(2, 16, 2, 64)
    assert cpu_decode_attention.supports(torch.zeros(1, 4, 64), cache)
    assert not cpu_decode_attention.supports(torch.zeros(1, 4, 64, dtype=torch.bfloat16), cache)
    assert not cpu_decode_attention.supports(torch.zeros(1, 4, 60), torch.zeros(2, 16, 2, 60))  # d % 8
    assert not cpu_decode_attention.supports(torch.zeros(1, 34, 64), cache)  # 17 query heads per KV head
    assert cpu_decode_attention.supports(torch.zeros(1, 4, 64), cache.half())
    assert not cpu_decode_attention.supports(torch.zeros(1, 4, 64), cache.bfloat16())


def test_store_kv_writes_what_the_torch_store_writes():
    from decodelab_kernels import store_kvcache_torch

    cache = make_paged_cache([40], 16, 3, 64, spare_blocks=4)
    qkv = torch.randn(5, 15 * 64)  # rows of the fused projection: q, then k, then v heads
    k, v = qkv[:, 9 * 64:12 * 64].view(5, 3, 64), qkv[:, 12 * 64:].view(5, 3, 64)
    slots = torch.tensor([3, 70, 71, 16, 100])
    want_k, want_v = cache.k_cache.clone(), cache.v_cache.clone()
    store_kvcache_torch(k, v, want_k, want_v, slots)
    cpu_decode_attention.store_kv(k, v, cache.k_cache, cache.v_cache, slots)
    assert torch.equal(cache.k_cache, want_k) and torch.equal(cache.v_cache, want_v)


def test_store_kv_into_an_fp16_cache_rounds_as_torch_does():
    """Round to nearest, ties to even, as .half(): ties and values past fp16's range included."""
    from decodelab_kernels import store_kvcache_torch

    cache = make_paged_cache([40], 16, 3, 64, spare_blocks=4)
    kc, vc = cache.k_cache.half(), cache.v_cache.half()
    qkv = torch.randn(5, 15 * 64) * 3
    qkv[0, 9 * 64:9 * 64 + 4] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 70000.0, -1e-8])  # two ties, overflow
    k, v = qkv[:, 9 * 64:12 * 64].view(5, 3, 64), qkv[:, 12 * 64:].view(5, 3, 64)
    slots = torch.tensor([3, 70, 71, 16, 100])
    want_k, want_v = kc.clone(), vc.clone()
    store_kvcache_torch(k, v, want_k, want_v, slots)
    cpu_decode_attention.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert kc.view(-1, 3, 64)[3, 0, 0] == 1.0 and kc.view(-1, 3, 64)[3, 0, 2] == float("inf")


def test_the_build_follows_the_cpu_and_decodelab_cpu_isa(build, monkeypatch):
    from decodelab_kernels import _cbuild

    monkeypatch.setenv("DECODELAB_CPU_ISA", "")
    has_avx512 = "avx512f" in _cbuild.cpu_flags()
    assert cpu_decode_attention.build_name() == ("avx512" if has_avx512 else "avx2")
    assert (cpu_decode_attention.BUILDS["avx512"].unavailable() is None) == has_avx512
    monkeypatch.setenv("DECODELAB_CPU_ISA", "avx2")
    assert cpu_decode_attention.build_name() == "avx2" and cpu_decode_attention.kernel().flags == ()


def test_the_two_builds_agree_to_rounding_and_each_is_deterministic():
    """The 16-lane build sums scores as a tree and four heads' weighted V rows at once: other roundings than the
    8-lane build's, the same attention (a wrong lane order in the tree would be off by whole scores)."""
    if (why := cpu_decode_attention.BUILDS["avx512"].unavailable()) is not None:
        pytest.skip(f"no avx512 decode attention here: {why}")
    cache = make_paged_cache([300, 17, 64, 129], 16, 2, 128, seed=5)
    q = torch.randn(4, 14, 128, generator=torch.Generator().manual_seed(5))  # 7 query heads a KV head: 4 + 3
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 128 ** -0.5)
    outs = {}
    for isa in ("", "avx2"):
        with pytest.MonkeyPatch.context() as m:
            m.setenv("DECODELAB_CPU_ISA", isa)
            outs[isa] = cpu_decode_attention.paged_decode(*args)
            assert torch.equal(outs[isa], cpu_decode_attention.paged_decode(*args))
    torch.testing.assert_close(outs[""], outs["avx2"], rtol=1e-5, atol=1e-6)
