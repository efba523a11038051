"""kernels/cpu_int8.c, our AVX2 int8 weight x fp32 activation matmul, against a float64 reference: every block
shape (rows 1-9 and more, outputs and inner sizes off its 4 x 8 grid), the bias, a row alone or in any batch
(its build's fall-back: test_cbuild.py)."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import cpu_int8

pytestmark = pytest.mark.skipif(cpu_int8.unavailable() is not None,
                                reason=f"no avx2 int8 kernel here: {cpu_int8.unavailable()}")


def reference(x, q, scale, bias):
    y = (x.double() @ q.double().T) * scale.double()
    return y if bias is None else y + bias.double()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 13), n=st.integers(1, 37), k=st.integers(1, 70), bias=st.booleans(),
       seed=st.integers(0, 10_000))
@example(rows=8, n=960, k=576, bias=False, seed=0)  # a SmolLM2 qkv projection, the four-mode batch
@example(rows=1, n=576, k=1536, bias=True, seed=1)  # down_proj at batch 1
def test_matches_the_float64_product_and_each_row_is_batch_invariant(rows, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_int8.linear(x, q, scale, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    want = reference(x, q, scale, b)
    # fp32 sums of k products: a few ulps per term at most
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5 * float(scale.max()) * 127)
    for i in range(rows):
        assert torch.equal(cpu_int8.linear(x[i:i + 1], q, scale, b)[0], got[i])


def test_strided_inputs_are_read_as_their_values():
    x = torch.randn(16, 64)[::2]  # every other row: not contiguous
    q = torch.randint(-127, 128, (12, 64), dtype=torch.int8)
    scale = torch.full((12,), 0.01)
    assert torch.equal(cpu_int8.linear(x, q, scale), cpu_int8.linear(x.contiguous(), q, scale))
