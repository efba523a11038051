"""kernels/cpu_int8_rows.h, our int8 kernel's many-rows matmul (`cpu_int8.Matrix.rows`): against the exact
reference of the same integers (test_cpu_int8.py `exact`) in every weight format (8-bit and 4-bit codes, fp32 and
fp16 steps), row counts on and off its panels (16 or 8 rows) and blocks, outputs off its slabs, a row alone
against its batch bit for bit, NaN / inf rows; and the engine's choice of it (`Int8Weight`).

Each test runs on every build that has it and runs here: "avx512" (zmm, vpmaddwd + vpaddd) where the CPU has AVX-512
(the skip names what it lacks) and its SIMDe twin on every x86 CPU. The VNNI and AVX2 builds have none (the AVX2 one
until session 33): their `rows` is their decode matmul (tested here too)."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine_service.engine.models.int8_linear import ROWS_MIN, Int8Weight, generated_rows
from kernels import cpu_int8
from tests.helpers import cpu_int8_build
from tests.kernels.test_cpu_int8 import as_multiplied, exact, gguf_grid, q4_grid

ROW_ISAS = [cpu_int8_build(name) for name in ("avx512", "avx512-simde")]
LANE_ISAS = [cpu_int8_build(name) for name in ("avx512vnni", "avx512vnni-simde", "avx2")]


@pytest.fixture(autouse=True)
def formats_on(monkeypatch):
    # the default formats and the many-rows matmul, also in a run that forces their fallbacks off
    for switch in ("DECODELAB_INT8_ROWS", "DECODELAB_INT8_NIBBLES", "DECODELAB_INT8_HALF_SCALES"):
        monkeypatch.delenv(switch, raising=False)


def check_rows(x, w: cpu_int8.GroupedInt8, bias=None, isa=None) -> torch.Tensor:
    """`rows` against `exact` (the tolerance of test_cpu_int8.check: fp32 rounds the group sums and steps), against
    the decode matmul to that rounding, and each row alone against its batch, bit for bit"""
    matrix = cpu_int8.Matrix(w, bias, isa)
    assert matrix.has_rows
    w = as_multiplied(w, matrix)
    got = matrix.rows(x)
    assert got.shape == (x.shape[0], w.n) and got.dtype == torch.float32
    terms = x.abs().amax(1, keepdim=True).double() * (w.u.double().view(w.n, -1, 32).sum(-1) * w.d.double()
                                                      + 32 * w.m.double().abs()).sum(-1)
    assert ((got.double() - exact(x, w, bias).double()).abs() <= 1e-6 * terms + 1e-6).all()
    # the decode matmul: the same products to the rounding of its lanes (the VNNI build's grid is 32639, not 32767)
    assert ((got.double() - matrix(x).double()).abs() <= 2e-4 * terms + 1e-6).all()
    for i in {0, x.shape[0] // 2, x.shape[0] - 1} if x.shape[0] else ():
        assert torch.equal(matrix.rows(x[i:i + 1])[0], got[i])
    return got


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 70), n=st.integers(1, 21), k=st.integers(1, 100), bias=st.booleans(),
       seed=st.integers(0, 10_000))
@example(rows=64, n=960, k=576, bias=False, seed=0)  # a SmolLM2 qkv projection at ROWS_MIN prompt rows
@example(rows=33, n=9, k=37, bias=True, seed=1)  # two full panels and one row, a part-filled slab and group
@pytest.mark.parametrize("isa", ROW_ISAS)
def test_rows_match_their_reference_and_each_row_is_batch_invariant(isa, rows, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + torch.randn(n, 1, generator=g) * 0.02
    w[torch.rand(n, k, generator=g) < 0.01] *= 40  # a few outliers: wide groups
    b = torch.randn(n, generator=g) if bias else None
    check_rows(torch.randn(rows, k, generator=g), cpu_int8.quantize(w), b, isa)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 21), k=st.sampled_from([32, 64, 96]), seed=st.integers(0, 10_000))
@pytest.mark.parametrize("isa", ROW_ISAS)
def test_rows_take_4_bit_codes(isa, rows, n, k, seed):
    w = cpu_int8.quantize(q4_grid(n, k, seed))
    assert cpu_int8.Matrix(w, isa=isa).nibbles
    check_rows(torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)), w, isa=isa)


@pytest.mark.parametrize("isa", ROW_ISAS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_rows_take_a_gguf_grid_with_fp16_steps_and_offsets(isa, kind):
    grouped = cpu_int8.quantize(gguf_grid(37, 96, 3, kind))
    matrix = cpu_int8.Matrix(grouped, isa=isa)
    assert matrix.half and matrix.nibbles == (kind == "q4_1")
    check_rows(torch.randn(40, 96), grouped, isa=isa)


@pytest.mark.parametrize("isa", ROW_ISAS)
def test_a_nan_or_inf_row_is_nan_through_rows_and_leaves_the_others(isa):
    x = torch.randn(20, 40)
    x[0, 17], x[18, 33] = float("nan"), float("inf")
    got = cpu_int8.Matrix(cpu_int8.quantize(torch.randn(5, 40)), isa=isa).rows(x)
    assert got[0].isnan().all() and got[18].isnan().all() and got[1:18].isfinite().all()


@pytest.mark.parametrize("isa", ROW_ISAS)
def test_strided_rows_are_read_as_their_values(isa):
    matrix = cpu_int8.Matrix(cpu_int8.quantize(torch.randn(12, 64)), isa=isa)
    x = torch.randn(40, 100)[:, 10:74]
    assert torch.equal(matrix.rows(x), matrix.rows(x.contiguous()))


@pytest.mark.parametrize("isa", LANE_ISAS)
def test_the_vnni_and_avx2_builds_run_every_row_through_their_decode_matmul(isa):
    matrix = cpu_int8.Matrix(cpu_int8.quantize(torch.randn(40, 64)), isa=isa)
    x = torch.randn(70, 64)
    assert not matrix.has_rows and torch.equal(matrix.rows(x), matrix(x))
    if isa in ("avx512vnni", "avx2"):  # so the engine sends prompt rows to it as every other row
        assert not Int8Weight(torch.randn(24, 64), None, isa, prompt_rows=True).prompt_rows


@pytest.mark.parametrize("isa", ROW_ISAS)
def test_the_avx512_build_has_rows_and_the_switch_turns_them_off(isa, monkeypatch):
    w = cpu_int8.quantize(torch.randn(8, 64))
    assert cpu_int8.Matrix(w, isa=isa).has_rows
    monkeypatch.setenv("DECODELAB_INT8_ROWS", "0")
    off = cpu_int8.Matrix(w, isa=isa)
    x = torch.randn(20, 64)
    assert not off.has_rows and torch.equal(off.rows(x), off(x))  # the decode matmul


ROUTED = next((name for name in ("avx512", "avx512-simde") if cpu_int8.unavailable(name) is None), None)


@pytest.mark.skipif(ROUTED is None, reason="no build of ours with a many-rows matmul runs here")
def test_int8_weight_sends_prompt_rows_from_rows_min_on_to_rows_and_every_other_row_to_the_decode_matmul(
        monkeypatch):
    isa = ROUTED
    w = torch.randn(24, 64)
    decoder, head = Int8Weight(w, None, isa, prompt_rows=True), Int8Weight(w, None, isa)
    assert decoder.prompt_rows and not head.prompt_rows
    calls = []
    for name in ("__call__", "rows"):
        inner = getattr(cpu_int8.Matrix, name)
        monkeypatch.setattr(cpu_int8.Matrix, name,
                            lambda self, t, inner=inner, name=name: calls.append((name, t.shape[0])) or inner(self, t))
    x = torch.randn(3 + ROWS_MIN, 64)

    def run(weight, rows, generated):
        calls.clear()
        token = generated_rows.set(generated)
        try:
            return weight(x[:rows])
        finally:
            generated_rows.reset(token)

    got = run(decoder, 3 + ROWS_MIN, 3)  # 3 decode rows, ROWS_MIN prompt rows
    assert calls == [("__call__", 3), ("rows", ROWS_MIN)]
    assert torch.equal(got[3:], decoder.matrix.rows(x[3:])) and torch.equal(got[:3], decoder.matrix(x[:3]))
    run(decoder, 2 + ROWS_MIN, 3)  # one prompt row short: all on the decode matmul
    assert calls == [("__call__", 2 + ROWS_MIN)]
    run(decoder, ROWS_MIN, 0)
    assert calls == [("rows", ROWS_MIN)]
    run(head, 3 + ROWS_MIN, 0)  # the LM head (and the roofline's weight) stay on the decode matmul
    assert calls == [("__call__", 3 + ROWS_MIN)]
    monkeypatch.setenv("DECODELAB_INT8_ROWS", "0")
    assert not Int8Weight(w, None, isa, prompt_rows=True).prompt_rows
