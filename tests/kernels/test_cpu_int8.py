"""kernels/cpu_int8.c, our AVX2 int8 weight x int16-quantized activation matmul: against its exact integer
reference and the float64 product, every block shape (rows 1-9 and more, outputs and inner sizes off its 4 x 16
grid), the bias, a row alone or in any batch, inputs whose int32 lanes would overflow at 16 bits, NaN and inf
(its build's fall-back: test_cbuild.py)."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels import cpu_int8

pytestmark = pytest.mark.skipif(cpu_int8.unavailable() is not None,
                                reason=f"no avx2 int8 kernel here: {cpu_int8.unavailable()}")


def quantized_rows(x, xmax=32767):
    """what the kernel multiplies: each row rounded (half to even) on the fp32 grid max|x| / xmax, and the step"""
    step = torch.where(x.abs().amax(1) > 0, x.abs().amax(1) / xmax, torch.ones(()))
    return torch.round(x * (1 / step)[:, None]), step


def exact(x, q, scale, bias, xmax=32767):
    """the kernel's result computed in float64: integer sums are exact there"""
    xq, step = quantized_rows(x, xmax)
    y = (xq.double() @ q.double().T) * (step.double()[:, None] * scale.double())
    return y if bias is None else y + bias.double()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 13), n=st.integers(1, 37), k=st.integers(1, 70), bias=st.booleans(),
       seed=st.integers(0, 10_000))
@example(rows=8, n=960, k=576, bias=False, seed=0)  # a SmolLM2 qkv projection, the four-mode batch
@example(rows=1, n=576, k=1536, bias=True, seed=1)  # down_proj at batch 1
@example(rows=7, n=10, k=37, bias=True, seed=2)  # chunks of 4 and 3 rows, a part-filled group, a padded k-step
def test_matches_its_integer_reference_and_the_float_product_and_each_row_is_batch_invariant(rows, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_int8.linear(x, q, scale, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # the integer sums are exact; fp32 rounds the 8 lane sums and the two scales: a few ulps
    unit = 127 * float(scale.max()) * float(x.abs().max()) if rows else 0.0
    assert torch.allclose(got.double(), exact(x, q, scale, b), rtol=1e-5, atol=1e-6 * unit)
    # int16 activations: each off by at most half a step (max|x| / 32767 / 2) from fp32's
    fp = (x.double() @ q.double().T) * scale.double() + (0 if b is None else b.double())
    assert ((got.double() - fp).abs() <= k * unit / 32767 / 2 + 1e-5 * unit + 1e-6).all()
    for i in range(rows):
        assert torch.equal(cpu_int8.linear(x[i:i + 1], q, scale, b)[0], got[i])


def test_strided_inputs_are_read_as_their_values():
    x = torch.randn(16, 64)[::2]  # every other row: not contiguous
    q = torch.randint(-127, 128, (12, 64), dtype=torch.int8)
    scale = torch.full((12,), 0.01)
    assert torch.equal(cpu_int8.linear(x, q, scale), cpu_int8.linear(x.contiguous(), q, scale))
    xt = torch.randn(64, 5).T  # a transposed matrix: its elements 5 apart within a row
    assert torch.equal(cpu_int8.linear(xt, q, scale), cpu_int8.linear(xt.contiguous(), q, scale))


def test_long_rows_use_fewer_activation_bits_instead_of_overflowing():
    # K = 20,000 products of 127 x 32767 in a lane would pass int32; the kernel quantizes to fewer levels instead
    k = 20_000
    x = torch.ones(2, k)
    x[1] = -1
    q = torch.full((3, k), 127, dtype=torch.int8)
    got = cpu_int8.linear(x, q, torch.ones(3))
    assert torch.allclose(got, torch.tensor([[127.0 * k] * 3, [-127.0 * k] * 3]), rtol=1e-6)
    xmax = int(2**31 * 8 / (127 * k))
    y = torch.randn(1, k)
    assert torch.allclose(cpu_int8.linear(y, q, torch.ones(3)).double(), exact(y, q, torch.ones(3), None, xmax),
                          rtol=1e-5)


def test_a_nan_or_inf_in_a_row_makes_that_row_nan_and_leaves_the_others():
    x = torch.randn(3, 40)
    x[0, 17] = float("nan")
    x[2, 33] = float("inf")
    q = torch.randint(-127, 128, (5, 40), dtype=torch.int8)
    got = cpu_int8.linear(x, q, torch.full((5,), 0.01))
    assert got[0].isnan().all() and got[2].isnan().all() and got[1].isfinite().all()


def test_pack_interleaves_four_rows_per_k_step_and_pads_with_zeros():
    q = torch.arange(6 * 20, dtype=torch.int64).remainder(251).sub(125).to(torch.int8).view(6, 20)
    p = cpu_int8.pack(q)
    assert p.shape == (2, 2, 4, 16) and p.is_contiguous()  # 6 rows -> 2 groups of 4; K 20 -> 2 k-steps of 16
    for n in range(6):
        for k in range(20):
            assert p[n // 4, k // 16, n % 4, k % 16] == q[n, k]
    assert (p[1, :, 2:] == 0).all() and (p[:, 1, :, 4:] == 0).all()  # the padding rows and columns
