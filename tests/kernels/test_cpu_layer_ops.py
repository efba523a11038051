"""decodelab_kernels/cpu_layer_ops.c against float64 references (RMSNorm with and without the residual add, SiLU * up)
and bit for bit against model.apply_rope; strided rows as the model passes them; each row alone or in any batch."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from decodelab_kernels import cpu_layer_ops
from engine_service.engine.models.llama import apply_rope

pytestmark = pytest.mark.skipif(cpu_layer_ops.unavailable() is not None,
                                reason=f"no avx2 layer ops here: {cpu_layer_ops.unavailable()}")


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 9), n=st.integers(1, 80), residual=st.booleans(), pad=st.integers(0, 5),
       seed=st.integers(0, 10_000))
@example(rows=8, n=576, residual=True, pad=0, seed=0)  # SmolLM2's hidden size, the four-mode batch
def test_rms_norm_is_the_float64_norm_of_x_plus_the_residual(rows, n, residual, pad, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n + pad, generator=g)[:, :n] * 3  # rows `pad` apart: a strided view
    w = torch.randn(n, generator=g)
    h = torch.randn(rows, n, generator=g) if residual else None
    s, y = cpu_layer_ops.rms_norm(x, w, 1e-5, h)
    want_s = x.double() + (h.double() if residual else 0)
    assert torch.equal(s, x + h) if residual else s is x
    want = want_s * torch.rsqrt(want_s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    for i in range(rows):
        assert torch.equal(cpu_layer_ops.rms_norm(x[i:i + 1], w, 1e-5, None if h is None else h[i:i + 1])[1][0], y[i])


def test_rms_norm_agrees_with_pytorchs_to_a_few_ulps():
    x, w = torch.randn(4, 576), torch.randn(576)
    torch.testing.assert_close(cpu_layer_ops.rms_norm(x, w, 1e-6)[1], F.rms_norm(x, (576,), w, 1e-6))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 9), heads=st.integers(1, 6), half=st.integers(1, 40), extra=st.integers(0, 20),
       seed=st.integers(0, 10_000))
@example(rows=3, heads=12, half=32, extra=192, seed=0)  # SmolLM2: 9 query + 3 key heads of 64, then v
def test_rope_in_place_is_apply_rope_bit_for_bit_and_leaves_the_rest_of_the_row(rows, heads, half, extra, seed):
    g = torch.Generator().manual_seed(seed)
    d = 2 * half
    x = torch.randn(rows, heads * d + extra, generator=g)
    cos, sin = torch.randn(rows, 1, d, generator=g), torch.randn(rows, 1, d, generator=g)
    want = apply_rope(x[:, :heads * d].reshape(rows, heads, d), cos, sin).reshape(rows, heads * d)
    got = x.clone()
    cpu_layer_ops.rope_(got, heads, d, cos, sin)
    assert torch.equal(got[:, :heads * d], want) and torch.equal(got[:, heads * d:], x[:, heads * d:])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 9), i=st.integers(1, 70), seed=st.integers(0, 10_000))
@example(rows=8, i=1536, seed=0)  # SmolLM2's MLP
def test_silu_mul_is_the_float64_product(rows, i, seed):
    gu = torch.randn(rows, 2 * i, generator=torch.Generator().manual_seed(seed)) * 6
    got = cpu_layer_ops.silu_mul(gu)
    gate, up = gu.double().chunk(2, dim=-1)
    torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    for r in range(rows):
        assert torch.equal(cpu_layer_ops.silu_mul(gu[r:r + 1])[0], got[r])


def test_silu_of_large_gates_stays_finite():
    gu = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0] * 2])
    got = cpu_layer_ops.silu_mul(gu)
    torch.testing.assert_close(got, F.silu(gu[:, :5]) * gu[:, 5:])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 9), n=st.integers(1, 80), pad=st.integers(0, 5), zero_row=st.booleans(),
       bias=st.booleans(), out=st.integers(1, 40), seed=st.integers(0, 10_000))
@example(rows=8, n=576, pad=0, zero_row=False, bias=True, out=960, seed=0)  # SmolLM2's qkv (Qwen2 has a bias)
def test_the_row_scaling_around_fbgemm_is_pytorchs_bit_for_bit(rows, n, pad, zero_row, bias, out, seed):
    """int8_linear's fbgemm path: x / r with r the row's max |x| (at least 1e-30), and y * r (+ bias) after."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n + pad, generator=g)[:, :n] * torch.rand(rows, 1, generator=g) * 50
    if zero_row and rows:
        x[0] = 0
    xn, r = cpu_layer_ops.row_absmax_div(x)
    want_r = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) if rows else torch.empty(0, 1)
    assert torch.equal(r, want_r) and torch.equal(xn, x / want_r)
    y, b = torch.randn(rows, out, generator=g), torch.randn(out, generator=g) if bias else None
    want = y * r if b is None else torch.addcmul(b, y, r)
    assert cpu_layer_ops.row_scale_(y, r, b) is y and torch.equal(y, want)
