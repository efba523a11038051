"""decodelab_kernels/cpu_int8.c, cpu_int8_avx512.c and cpu_int8_vnni.c, our AVX2, AVX-512 and AVX512-VNNI kernels for
grouped 8-bit weights x int16-quantized activations: each against its exact reference (the same integers in float64) and
the float product, every block shape (rows 1-9 and more, past the VNNI build's 16-row chunks and the AVX2 build's 4;
outputs and inner sizes off its 4 x 32 or 16 x 32 grid), the bias, a row alone or in any batch, long rows, NaN and
inf (its build's fall-back: test_cbuild.py); `quantize`, its weight format (GroupedInt8), and the packed layouts.

Each test runs on every build that runs here: "avx2" where the CPU has AVX2, "avx512" where it has AVX-512 F + BW,
"avx512vnni" where it has AVX512-VNNI too, "amx" where it has AMX-INT8 as well (the skips name what it lacks), and
"avx512-simde", "avx512vnni-simde" and "amx-simde", the AVX-512 sources on SIMDe's portable intrinsics (Debian's
libsimde-dev, which `make test` installs; "amx-simde" with AMX's tiles in plain C, decodelab_kernels/cpu_amx.h), so
those builds' logic is checked on every x86 CPU."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from decodelab_kernels import cpu_int8
from tests.helpers import cpu_int8_build

ISAS = [cpu_int8_build(name) for name in cpu_int8.KERNELS]


def quantized_rows(x, xmax=32767):
    """what the kernel multiplies: each row rounded (half to even) on the fp32 grid max|x| / xmax, and the step"""
    step = torch.where(x.abs().amax(1) > 0, x.abs().amax(1) / xmax, torch.ones(()))
    return torch.round(x * (1 / step)[:, None]), step


def exact(x, w: cpu_int8.GroupedInt8, bias=None, xmax=32767):
    """the kernel's result in float64 from the same integers: per group d * (xq . u) + m * sum(xq), times the step"""
    xq, step = quantized_rows(x, xmax)
    xq = torch.nn.functional.pad(xq.double(), (0, w.u.shape[1] - w.k)).view(x.shape[0], 1, w.d.shape[1], 32)
    u = w.u.double().view(w.n, -1, 32)
    y = ((xq * u).sum(-1) * w.d.double() + xq.sum(-1) * w.m.double()).sum(-1) * step.double()[:, None]
    return y if bias is None else y + bias.double()


def as_multiplied(w: cpu_int8.GroupedInt8, matrix: cpu_int8.Matrix) -> cpu_int8.GroupedInt8:
    """w with the steps and offsets the kernel multiplies by: rounded to fp16 where the Matrix holds them so (a
    GGUF's scales are fp16 values; any other matrix takes them 1 time in 32 per group, changed by <= 2^-16)"""
    if not matrix.half:
        return w
    scale = 17 if matrix.nibbles else 1
    return cpu_int8.GroupedInt8(w.u, (w.d * scale).half().float() / scale, w.m.half().float(), w.k)


def check(x, w: cpu_int8.GroupedInt8, bias=None, isa=None) -> torch.Tensor:
    """the kernel against `exact` (fp32 rounds the group sums, the steps and the lanes: a few ulps of the terms'
    magnitude) and each row alone against its batch, bit for bit"""
    matrix = cpu_int8.Matrix(w, bias, isa)
    w = as_multiplied(w, matrix)
    got = matrix(x)
    assert got.shape == (x.shape[0], w.n) and got.dtype == torch.float32
    terms = x.abs().amax(1, keepdim=True).double() * (w.u.double().view(w.n, -1, 32).sum(-1) * w.d.double()
                                                      + 32 * w.m.double().abs()).sum(-1)
    want = exact(x, w, bias, cpu_int8.ACTIVATION_MAX[matrix.kernel.name])
    assert ((got.double() - want).abs() <= 1e-6 * terms + 1e-6).all()
    for i in range(x.shape[0]):
        assert torch.equal(matrix(x[i:i + 1])[0], got[i])
    return got


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 13), n=st.integers(1, 37), k=st.integers(1, 70), bias=st.booleans(),
       seed=st.integers(0, 10_000))
@example(rows=8, n=960, k=576, bias=False, seed=0)  # a SmolLM2 qkv projection, the four-mode batch
@example(rows=1, n=576, k=1536, bias=True, seed=1)  # down_proj at batch 1
@example(rows=7, n=10, k=37, bias=True, seed=2)  # chunks of 4 and 3 rows, a part-filled group, a padded k-step
@example(rows=35, n=37, k=70, bias=True, seed=4)  # VNNI: chunks of 12, 12, 11 rows; slabs of 16, 16 and 5 outputs
@pytest.mark.parametrize("isa", ISAS)
def test_per_row_int8_matches_its_reference_and_the_float_product_and_each_row_is_batch_invariant(isa, rows, n, k, bias,
                                                                                                   seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    b = torch.randn(n, generator=g) if bias else None
    got = check(x, cpu_int8.GroupedInt8.from_int8(q, scale), b, isa)
    assert torch.equal(cpu_int8.linear(x, q, scale, b, isa), got)
    # int16 activations: each off by at most half a step (max|x| / 32767 / 2) from fp32's
    unit = 127 * float(scale.max()) * float(x.abs().max()) if rows else 0.0
    fp = (x.double() @ q.double().T) * scale.double() + (0 if b is None else b.double())
    assert ((got.double() - fp).abs() <= k * unit / 32767 / 2 + 1e-5 * unit + 1e-6).all()


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(1, 21), k=st.integers(1, 100), outliers=st.booleans(),
       seed=st.integers(0, 10_000))
@example(rows=4, n=576, k=1536, outliers=True, seed=3)  # SmolLM2's down_proj
@example(rows=17, n=21, k=100, outliers=True, seed=5)  # chunks of 9 and 8 (VNNI), a slab of 5 outputs
@example(rows=70, n=40, k=576, outliers=True, seed=6)  # a prompt chunk's rows: 5 chunks of 14 (VNNI, AVX-512)
@pytest.mark.parametrize("isa", ISAS)
def test_grouped_weights_match_their_reference_and_are_batch_invariant(isa, rows, n, k, outliers, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + (torch.randn(n, 1, generator=g) * 0.02)
    if outliers:  # a few large weights, and one row far from zero (every group's offset large)
        w[torch.rand(n, k, generator=g) < 0.01] *= 40
        w[0] += 3.0
    check(torch.randn(rows, k, generator=g), cpu_int8.quantize(w), isa=isa)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 100), spread=st.sampled_from([1e-6, 1.0, 1e4]),
       offset=st.sampled_from([0.0, 1.0, -50.0]), seed=st.integers(0, 10_000))
@example(n=2, k=64, spread=0.0, offset=0.0, seed=0)  # all-zero rows
@example(n=2, k=64, spread=0.0, offset=2.0, seed=0)  # constant rows: zero range in every group
def test_quantize_keeps_each_weight_within_half_a_step_of_its_groups_range(n, k, spread, offset, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * spread + offset
    grouped = cpu_int8.quantize(w)
    assert grouped.u.shape == (n, -(-k // 32) * 32) and grouped.d.shape == grouped.m.shape == (n, -(-k // 32))
    groups = torch.nn.functional.pad(w, (0, -k % 32)).view(n, -1, 32)
    assert torch.equal(grouped.m, groups.amin(2))  # the offset: the group's minimum (padding zeros count)
    step = grouped.d.repeat_interleave(32, dim=1)[:, :k]
    assert ((grouped.dequantize() - w).abs() <= step * 0.5001 + 1e-6 * w.abs().amax(1, keepdim=True)).all()


def test_a_grid_of_16_levels_in_a_group_is_kept_exactly():
    # llama.cpp's Q4_1 (SmolLM2's weights as installed): m + d * q, q in 0..15 -> step d / 17, codes 17 q
    d, m = torch.rand(6, 3) * 0.01 + 1e-3, torch.randn(6, 3) * 0.02
    q = torch.randint(0, 16, (6, 3, 32))
    q[..., 0], q[..., 1] = 0, 15
    w = (m[..., None] + d[..., None] * q).view(6, 96)
    assert torch.allclose(cpu_int8.quantize(w).dequantize(), w, rtol=0, atol=1e-6 * float(w.abs().max()))


def test_per_row_int8_maps_onto_the_grouped_form_exactly():
    q = torch.randint(-127, 128, (5, 40), dtype=torch.int8)
    assert torch.equal(cpu_int8.GroupedInt8.from_int8(q, torch.full((5,), 0.5)).dequantize(), q.float() * 0.5)


@pytest.mark.parametrize("isa", ISAS)
def test_strided_inputs_are_read_as_their_values(isa):
    x = torch.randn(16, 64)[::2]  # every other row: not contiguous
    q = torch.randint(-127, 128, (12, 64), dtype=torch.int8)
    scale = torch.full((12,), 0.01)
    assert torch.equal(cpu_int8.linear(x, q, scale, isa=isa), cpu_int8.linear(x.contiguous(), q, scale, isa=isa))
    xt = torch.randn(64, 5).T  # a transposed matrix: its elements 5 apart within a row
    assert torch.equal(cpu_int8.linear(xt, q, scale, isa=isa), cpu_int8.linear(xt.contiguous(), q, scale, isa=isa))


@pytest.mark.parametrize("isa", ISAS)
def test_long_rows_keep_all_16_activation_bits_without_overflowing(isa):
    # 20,000 products of 127 x 32767 would pass int32 in one lane; each group of 32 is added in fp32 instead
    k = 20_000
    x = torch.ones(2, k)
    x[1] = -1
    q = torch.full((3, k), 127, dtype=torch.int8)
    got = cpu_int8.linear(x, q, torch.ones(3), isa=isa)
    # fp32 sums of 625 groups, whose codes (q + 128) and offsets (-128) cancel to half their size: ~1e-5
    assert torch.allclose(got, torch.tensor([[127.0 * k] * 3, [-127.0 * k] * 3]), rtol=1e-4)
    check(torch.randn(2, k), cpu_int8.GroupedInt8.from_int8(q, torch.ones(3)), isa=isa)


@pytest.mark.parametrize("isa", ISAS)
def test_a_nan_or_inf_in_a_row_makes_that_row_nan_and_leaves_the_others(isa):
    x = torch.randn(3, 40)
    x[0, 17] = float("nan")
    x[2, 33] = float("inf")
    q = torch.randint(-127, 128, (5, 40), dtype=torch.int8)
    got = cpu_int8.linear(x, q, torch.full((5,), 0.01), isa=isa)
    assert got[0].isnan().all() and got[2].isnan().all() and got[1].isfinite().all()


def q4_grid(n: int, k: int, seed: int) -> torch.Tensor:
    """weights as a Q4_1 GGUF holds them: per group of 32, m + d * q with q in 0..15 spanning both ends (a GGUF's K
    is a multiple of 32: a padded group's zeros are off the grid, and the weight stays in 8-bit codes)"""
    g = torch.Generator().manual_seed(seed)
    groups = k // 32
    d, m = torch.rand(n, groups, 1, generator=g) * 0.01 + 1e-3, torch.randn(n, groups, 1, generator=g) * 0.02
    q = torch.randint(0, 16, (n, groups, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    return (m + d * q).view(n, k)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(1, 21), k=st.sampled_from([32, 64, 96]), seed=st.integers(0, 10_000))
@example(rows=1, n=576, k=1536, seed=1)  # SmolLM2's down_proj at batch 1
@example(rows=8, n=960, k=576, seed=0)  # its qkv projection, the four-mode batch
@example(rows=128, n=44, k=96, seed=2)  # a batched decode step's rows: 8 chunks of 16 (VNNI)
@pytest.mark.parametrize("isa", ISAS)
def test_q4_weights_run_as_4_bit_codes_with_the_8_bit_results(isa, rows, n, k, seed):
    w = cpu_int8.quantize(q4_grid(n, k, seed))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("DECODELAB_INT8_NIBBLES", raising=False)  # on, also in a run that forces the fallback
        four = cpu_int8.Matrix(w, isa=isa)
        assert cpu_int8.four_bit(w.u) and four.nibbles
        got = check(x, w, isa=isa)  # the 8-bit codes' reference, and each row alone against its batch
        mp.setenv("DECODELAB_INT8_NIBBLES", "0")
        eight = cpu_int8.Matrix(w, isa=isa)
    assert not eight.nibbles and eight.packed.numel() == 2 * four.packed.numel()
    # the same products; the steps differ by the fp32 rounding of d * 17
    torch.testing.assert_close(got, eight(x), rtol=1e-5, atol=1e-5 * float(got.abs().max()))


def test_a_q4_weight_with_groups_also_on_a_symmetric_grid_stays_4_bit(monkeypatch):
    monkeypatch.delenv("DECODELAB_INT8_NIBBLES", raising=False)  # on, also in a run that forces the fallback
    # a Q4_1 group with m = -113 / 1024 and d = 16 / 1024 (as in SmolLM2's o_proj) is also on Q8_0's grid (max |w| /
    # 127 = 1 / 1024, every value a whole multiple): the Q8_0 check must not re-code it and leave the matrix 8-bit
    w = q4_grid(8, 64, 0)
    w[0, :32] = (-113 + 16 * (torch.arange(32) % 16)) / 1024
    g = cpu_int8.quantize(w)
    assert cpu_int8.four_bit(g.u) and cpu_int8.Matrix(g).nibbles
    torch.testing.assert_close(g.dequantize()[:, :64], w, rtol=0, atol=1e-6)


def test_nibble_bytes_put_a_groups_32_codes_in_16_bytes_low_nibbles_first():
    u4 = torch.arange(6 * 64, dtype=torch.int64).remainder(16).to(torch.uint8).view(6, 64).flip(1)
    p = cpu_int8._nibble_bytes(u4)
    assert p.shape == (6, 2, 16)  # K 64 -> 2 groups of 32
    for n in range(6):
        for k in range(64):
            byte = int(p[n, k // 32, k % 16])
            assert (byte >> 4 if k % 32 >= 16 else byte & 15) == u4[n, k]
    assert not cpu_int8.four_bit(torch.tensor([[0, 17, 18]], dtype=torch.uint8))


def test_pack_wide_puts_16_rows_4_codes_each_in_a_piece_of_64_bytes():
    # the VNNI build's layout: slab, weight group, piece q, row, byte b = code at k 4q + b (4-bit: the nibble bytes)
    u = torch.arange(21 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).view(21, 64)
    p = cpu_int8.pack_wide(u, nibbles=False)
    assert p.shape == (2, 2, 8, 16, 4) and p.is_contiguous()  # 21 rows -> 2 slabs of 16; K 64 -> 2 groups of 32
    for n in range(21):
        for k in range(64):
            assert p[n // 16, k // 32, k % 32 // 4, n % 16, k % 4] == u[n, k]
    assert (p[1, :, :, 5:] == 0).all()  # the padding rows
    u4 = u % 16
    p4, bytes4 = cpu_int8.pack_wide(u4, nibbles=True), cpu_int8._nibble_bytes(u4)
    assert p4.shape == (2, 2, 4, 16, 4) and p4.numel() * 2 == p.numel()
    for n in range(21):
        for j in range(16):  # byte j of a group: codes k = j (low nibble) and 16 + j (high)
            for g in range(2):
                assert p4[n // 16, g, j // 4, n % 16, j % 4] == bytes4[n, g, j]
    d = torch.arange(42, dtype=torch.float32).view(21, 2)
    steps, offsets = cpu_int8.pack_wide_scales(d), cpu_int8.pack_wide_scales(d, torch.float16, 8)
    assert steps.shape == (2, 2, 16) and offsets.shape == (2, 8, 16) and offsets.dtype == torch.float16
    for n in range(21):
        for j in range(2):
            assert steps[n // 16, j, n % 16] == d[n, j] == offsets[n // 16, j, n % 16]
    assert (steps[1, :, 5:] == 0).all() and (offsets[:, 2:] == 0).all()


def test_pack_wide_with_lanes_of_2_puts_16_rows_2_codes_each_in_a_piece_of_32_bytes():
    # the AVX2 and AVX-512 builds' layout: slab, weight group, piece q, row, byte b = code at k 2q + b (4-bit: the
    # nibble bytes)
    u = torch.arange(21 * 64, dtype=torch.int64).remainder(251).to(torch.uint8).view(21, 64)
    p = cpu_int8.pack_wide(u, nibbles=False, lane=2)
    assert p.shape == (2, 2, 16, 16, 2) and p.is_contiguous()
    for n in range(21):
        for k in range(64):
            assert p[n // 16, k // 32, k % 32 // 2, n % 16, k % 2] == u[n, k]
    assert (p[1, :, :, 5:] == 0).all()  # the padding rows
    u4 = u % 16
    p4, bytes4 = cpu_int8.pack_wide(u4, nibbles=True, lane=2), cpu_int8._nibble_bytes(u4)
    assert p4.shape == (2, 2, 8, 16, 2) and p4.numel() * 2 == p.numel()
    for n in range(21):
        for j in range(16):  # byte j of a group: codes k = j (low nibble) and 16 + j (high)
            for g in range(2):
                assert p4[n // 16, g, j // 2, n % 16, j % 2] == bytes4[n, g, j]
    for isa in ("avx2", "avx512-simde"):
        assert cpu_int8.Matrix(cpu_int8.quantize(torch.randn(21, 64)), isa=isa).packed.shape == (2, 2, 16, 16, 2)


def test_four_bit_takes_exactly_the_multiples_of_17():
    for v in range(256):  # every byte, alone and beside a multiple of 17
        u = torch.tensor([[v, 34]], dtype=torch.uint8)
        assert cpu_int8.four_bit(u) == (v % 17 == 0), v
    assert cpu_int8.four_bit(torch.arange(16, dtype=torch.uint8).mul(17).repeat(40, 3))


@pytest.mark.parametrize("isa", [cpu_int8_build(name) for name in ("avx512", "avx512-simde")])
@pytest.mark.parametrize("nibbles", [False, True])
def test_the_avx512_build_gives_the_avx2_builds_bits(isa, nibbles, monkeypatch):
    if (why := cpu_int8.unavailable("avx2")) is not None:
        pytest.skip(f"the avx2 build does not run here: {why}")
    monkeypatch.delenv("DECODELAB_INT8_NIBBLES", raising=False)  # 4-bit codes on, also in a run forcing them off
    # SmolLM2's gate_up shape, 21 rows (AVX2 chunks of 4 or 3, AVX-512 of 11 and 10), Q4_1 weights (4-bit codes) or
    # free ones (8-bit codes): the same packed layout, integer sums, conversions and FMAs in the same order
    w = cpu_int8.quantize(q4_grid(3072, 576, 7) if nibbles else torch.randn(3072, 576) * 0.05)
    x = torch.randn(21, 576)
    wide, narrow = cpu_int8.Matrix(w, isa=isa), cpu_int8.Matrix(w, isa="avx2")
    assert wide.nibbles == narrow.nibbles == nibbles and torch.equal(wide.packed, narrow.packed)
    assert torch.equal(wide(x), narrow(x))


@pytest.mark.parametrize("isa", [cpu_int8_build(name) for name in ("amx", "amx-simde")])
@pytest.mark.parametrize("nibbles", [False, True])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("rows", [16, 17, 35, 64])
def test_the_amx_build_gives_the_vnni_builds_bits(isa, nibbles, half, rows, monkeypatch):
    vnni = "avx512vnni" if isa == "amx" else "avx512vnni-simde"  # the emulated tiles beside SIMDe's VNNI
    if (why := cpu_int8.unavailable(vnni)) is not None:
        pytest.skip(f"the {vnni} build does not run here: {why}")
    for switch in ("DECODELAB_INT8_NIBBLES", "DECODELAB_INT8_HALF_SCALES"):  # on, also in a run forcing them off
        monkeypatch.delenv(switch, raising=False)
    # whole blocks of 16 rows through the tiles and the rest (1, 3 rows) through the VNNI blocks; 40 outputs (slabs
    # of 16, 16 and 8) over 4 k-groups (free 8-bit weights with fp32 steps: k = 100, a padded last group); Q4_1
    # weights (4-bit codes, split per slab) or free ones (8-bit codes, the tiles' rows as packed); fp16 steps and
    # offsets as a GGUF's, or fp32
    n, k = 40, 128 if half or nibbles else 100
    if nibbles:
        w = gguf_grid(n, k, 5, "q4_1") if half else q4_grid(n, k, 5)
    else:
        w = gguf_grid(n, k, 5, "q8_0") if half else torch.randn(n, k) * 0.05
    grouped, bias = cpu_int8.quantize(w), torch.randn(n)
    tiles, ref = cpu_int8.Matrix(grouped, bias, isa), cpu_int8.Matrix(grouped, bias, vnni)
    assert (tiles.nibbles, tiles.half) == (nibbles, half) and torch.equal(tiles.packed, ref.packed)
    x = torch.randn(rows, k) * torch.logspace(-2, 2, k)  # every activation bit in play: large and small columns
    got = tiles(x)
    assert torch.equal(got, ref(x))
    assert torch.equal(tiles(x[rows - 16:]), got[rows - 16:])  # a row's bits from a block of other rows too


def test_the_build_is_chosen_from_the_cpu_and_decodelab_cpu_isa_narrows_it(monkeypatch):
    monkeypatch.delenv("DECODELAB_CPU_ISA", raising=False)  # the CPU's choice, also in a run forcing a narrower one
    amx, vnni, wide = cpu_int8.KERNELS["amx"], cpu_int8.KERNELS["avx512vnni"], cpu_int8.KERNELS["avx512"]
    assert cpu_int8.default_isa() == ("amx" if amx.unavailable() is None else
                                      "avx512vnni" if vnni.unavailable() is None
                                      else "avx512" if wide.unavailable() is None else "avx2")
    for name in ("amx", "avx512vnni", "avx512"):
        why = cpu_int8.KERNELS[name].unavailable()
        assert why is None or "avx512" in why or "amx" in why or "generic" in why  # names what the CPU lacks
    # as a CPU with the instructions would: the widest build that runs (SIMDe's in place of the ones missing here)
    for name in ("avx512", "avx512vnni", "amx"):
        if cpu_int8.unavailable(name) is not None and cpu_int8.unavailable(f"{name}-simde") is None:
            monkeypatch.setitem(cpu_int8.KERNELS, name, cpu_int8.KERNELS[f"{name}-simde"])
            assert cpu_int8.default_isa() == name
    monkeypatch.setenv("DECODELAB_CPU_ISA", "avx2")
    assert cpu_int8.default_isa() == "avx2" and cpu_int8.Matrix(cpu_int8.quantize(torch.ones(4, 32))).isa == "avx2"
    monkeypatch.setenv("DECODELAB_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="DECODELAB_CPU_ISA"):
        cpu_int8.default_isa()


def gguf_grid(n: int, k: int, seed: int, kind: str) -> torch.Tensor:
    """weights as llama.cpp's loader dequantizes them: Q4_1 (m + d * q, q in 0..15) or Q8_0 (d * q, q in -127..127,
    one |q| = 127), d and m fp16 values, per group of 32"""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    if kind == "q8_0":
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=g)
        q[..., 0] = 127 * torch.where(torch.rand(n, k // 32, generator=g) < 0.5, -1, 1)
        return (d * q).view(n, k)
    m = (torch.randn(n, k // 32, 1, generator=g) * 0.02).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    return (m + d * q).view(n, k)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_gguf_grid_is_kept_exactly_with_fp16_steps_and_offsets(isa, kind, monkeypatch):
    for switch in ("DECODELAB_INT8_NIBBLES", "DECODELAB_INT8_HALF_SCALES"):  # on, also in a run forcing them off
        monkeypatch.delenv(switch, raising=False)
    w = gguf_grid(37, 96, 3, kind)
    grouped = cpu_int8.quantize(w)
    # Q8_0's symmetric grid kept as it is (not re-quantized onto each group's min / max): bit for bit; Q4_1's to
    # the fp32 rounding of m + d * q (the fp16 steps below make the kernel's products exactly d * q)
    if kind == "q8_0":
        assert torch.equal(grouped.dequantize(), w)
    torch.testing.assert_close(grouped.dequantize(), w, rtol=0, atol=1e-6 * float(w.abs().max()))
    matrix = cpu_int8.Matrix(grouped, isa=isa)
    assert matrix.half and matrix.steps.dtype == matrix.offsets.dtype == torch.float16
    assert matrix.nibbles == (kind == "q4_1") and matrix.fmt == cpu_int8.FMT_HALF | matrix.nibbles
    x = torch.randn(6, 96)
    got = check(x, grouped, isa=isa)
    monkeypatch.setenv("DECODELAB_INT8_HALF_SCALES", "0")
    fp32 = cpu_int8.Matrix(grouped, isa=isa)
    assert not fp32.half and fp32.steps.dtype == torch.float32
    assert 2 * (matrix.steps.nbytes + matrix.offsets.nbytes) == fp32.steps.nbytes + fp32.offsets.nbytes
    torch.testing.assert_close(got, fp32(x), rtol=1e-5, atol=1e-5 * float(got.abs().max()))
    # weights from fp32 values (a safetensors checkpoint) keep fp32 steps: fp16 would round them
    assert not cpu_int8.Matrix(cpu_int8.quantize(torch.randn(8, 64)), isa=isa).half
