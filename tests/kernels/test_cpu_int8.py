"""kernels/cpu_int8.c, our AVX2 int8 weight x int16-quantized activation matmul: against its exact integer
reference and the float64 product, every block shape (rows 1-9 and more, outputs and inner sizes off its 4 x 32
grid), the bias, a row alone or in any batch, inputs whose int32 lanes would overflow at 16 bits, NaN and inf
(its build's fall-back: test_cbuild.py); and `quantize`, its grouped 8-bit weight format (GroupedInt8)."""
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
    """the kernel's result computed in float64: integer sums are exact there (q: the integer weights)"""
    xq, step = quantized_rows(x, xmax)
    y = (xq.double() @ q.double().T) * (step.double()[:, None] * scale.double())
    return y if bias is None else y + bias.double()


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(1, 21), k=st.integers(1, 100), outliers=st.booleans(),
       seed=st.integers(0, 10_000))
@example(rows=4, n=576, k=1536, outliers=True, seed=3)  # SmolLM2's down_proj
def test_grouped_weights_match_their_integer_reference_and_are_batch_invariant(rows, n, k, outliers, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + (torch.randn(n, 1, generator=g) * 0.02)
    if outliers:  # a few large weights, and one row far from zero (every group's offset large)
        w[torch.rand(n, k, generator=g) < 0.01] *= 40
        w[0] += 3.0
    x = torch.randn(rows, k, generator=g)
    grouped = cpu_int8.quantize(w)
    m = cpu_int8.Matrix(grouped)
    got = m(x)
    want = exact(x, grouped.integers(), grouped.scale, None, m.xmax)
    unit = float((x.abs().amax(1, keepdim=True) * grouped.dequantize().abs().sum(1)).max())
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * unit)
    for i in range(rows):
        assert torch.equal(m(x[i:i + 1])[0], got[i])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 100), spread=st.sampled_from([1e-6, 1.0, 1e4]),
       offset=st.sampled_from([0.0, 1.0, -50.0]), seed=st.integers(0, 10_000))
@example(n=2, k=64, spread=0.0, offset=0.0, seed=0)  # all-zero rows
@example(n=2, k=64, spread=0.0, offset=2.0, seed=0)  # constant rows: zero range in every group
def test_quantize_keeps_each_weight_within_half_a_step_of_its_groups_range(n, k, spread, offset, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * spread + offset
    grouped = cpu_int8.quantize(w)
    ints = grouped.integers()
    assert ints.abs().max() <= 32767 and grouped.u.shape == (n, -(-k // 32) * 32) and grouped.k == k
    assert ((grouped.a >= 1) & (grouped.a <= cpu_int8.STEPS)).all()
    # the error: half the group's step (scale * a), plus the row grid's half step where the offset rounds
    groups = torch.nn.functional.pad(w, (0, -k % 32)).view(n, -1, 32)
    step = (grouped.scale[:, None] * grouped.a).repeat_interleave(32, dim=1)[:, :k]
    bound = step / 2 + grouped.scale[:, None] + 1e-6 * w.abs().amax(1, keepdim=True)
    assert ((grouped.dequantize() - w).abs() <= bound).all()
    # a step is the group's range / 255 up to the grid of a: within scale of it once ranges are wide
    rng = (groups.amax(2) - groups.amin(2)).repeat_interleave(32, dim=1)[:, :k]
    assert (step <= rng / 255 + grouped.scale[:, None] * 1.0001).all()


def test_per_row_int8_maps_onto_the_grouped_form_exactly():
    q = torch.randint(-127, 128, (5, 40), dtype=torch.int8)
    w = cpu_int8.GroupedInt8.from_int8(q, torch.full((5,), 0.5))
    assert torch.equal(w.integers(), q.int()) and torch.equal(w.dequantize(), q.float() * 0.5)


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
    xmax = (2**31 - 1) // (127 * k // 8)  # a lane: every 16th pair of k
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
    u = torch.arange(6 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).view(6, 64)
    p = cpu_int8.pack(u)
    assert p.shape == (2, 4, 4, 16) and p.is_contiguous()  # 6 rows -> 2 groups of 4; K 64 -> 4 k-steps of 16
    for n in range(6):
        for k in range(64):
            assert p[n // 4, k // 16, n % 4, k % 16] == u[n, k]
    assert (p[1, :, 2:] == 0).all()  # the padding rows
    a = torch.arange(12, dtype=torch.int16).view(6, 2)
    ab = cpu_int8.pack_steps(a, -a)
    assert ab.shape == (2, 2, 4, 2)  # per group of 4 rows and group of 32 k: the 4 rows' (a, b)
    for n in range(6):
        for j in range(2):
            assert ab[n // 4, j, n % 4].tolist() == [a[n, j], -a[n, j]]
