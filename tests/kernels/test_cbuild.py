"""decodelab_kernels/_cbuild.py: where a C kernel cannot be built, it says why and leaves nothing behind."""
import pytest

from decodelab_kernels import _cbuild, cpu_decode_attention, cpu_decoder, cpu_int8, cpu_layer_ops, cpu_logits

KERNELS = {**{f"cpu_int8 {isa}": k for isa, k in cpu_int8.KERNELS.items()},
           **{f"cpu_decode_attention {isa}": k for isa, k in cpu_decode_attention.BUILDS.items()},
           **{m.__name__: m.KERNEL for m in (cpu_layer_ops, cpu_logits, cpu_decoder)}}


@pytest.mark.parametrize("name", KERNELS)
def test_without_a_compiler_it_reports_why_and_does_not_build(name, monkeypatch, tmp_path):
    kernel = KERNELS[name]
    if kernel.unavailable() is not None:
        pytest.skip(f"it does not build here anyway: {kernel.unavailable()}")
    monkeypatch.setenv("CC", "no-such-compiler-decodelab")
    monkeypatch.setenv("DECODELAB_CACHE_DIR", str(tmp_path))
    lib, why = _cbuild.build(kernel.name, kernel.flags, kernel.needs)  # what the kernel's first use does
    assert lib is None and "no C compiler" in why
    assert not any(tmp_path.rglob("*.so"))


@pytest.mark.parametrize("name", KERNELS)
def test_every_kernel_builds_and_loads_wherever_the_cpu_and_a_compiler_allow_it(name):
    """A compile error (say an intrinsic of an extension the build's flags lack: session 31's first VNNI draft used
    an AVX512-DQ one) must fail here: elsewhere it only reads as a skip, like a CPU without the instructions, and
    the engine would take a narrower build in silence."""
    why = KERNELS[name].unavailable()
    assert why is None or "failed" not in why, why


def test_a_build_for_instructions_the_cpu_lacks_names_them_and_is_not_built(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODELAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DECODELAB_CPU_ISA", raising=False)  # a run with the switch forced: what the CPU says
    monkeypatch.setattr(_cbuild, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f"})  # AVX-512 F without BW
    monkeypatch.setattr(_cbuild.platform, "machine", lambda: "x86_64")  # as on x86, wherever the test runs
    lib, why = _cbuild.build("cpu_int8_avx512", ("-mavx512f", "-mavx512bw"), ("avx512f", "avx512bw"))
    assert lib is None and "lacks avx512bw" in why and "avx512f" not in why.split("lacks")[1]
    assert not any(tmp_path.rglob("*.so"))


def test_decodelab_cpu_kernels_chooses_between_them_and_the_torch_paths(monkeypatch):
    monkeypatch.delenv("DECODELAB_CPU_KERNELS", raising=False)  # (the suite may run with the switch forced)
    assert _cbuild.enabled(None) and not _cbuild.enabled("no compiler")
    monkeypatch.setenv("DECODELAB_CPU_KERNELS", "torch")
    assert not _cbuild.enabled(None)
    monkeypatch.setenv("DECODELAB_CPU_KERNELS", "avx2")
    assert _cbuild.enabled(None)
    with pytest.raises(ValueError, match="does not run here"):
        _cbuild.enabled("no compiler")
    monkeypatch.setenv("DECODELAB_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="expected avx2 or torch"):
        _cbuild.enabled(None)


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le"])
def test_a_process_of_another_architecture_builds_nothing_whatever_cpuinfo_lists(machine, monkeypatch, tmp_path):
    """An arm64 container under QEMU on an x86 host reads the host's /proc/cpuinfo, avx2 and all: an x86 build
    there would not load (a wrong ELF machine), so the architecture decides first."""
    if not _cbuild.cpu_flags():
        pytest.skip("no x86 flags in /proc/cpuinfo here to be misled by")
    monkeypatch.setenv("DECODELAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DECODELAB_CPU_ISA", raising=False)
    monkeypatch.setattr(_cbuild.platform, "machine", lambda: machine)
    assert _cbuild.cpu_flags() == set() and _cbuild.missing(("avx2",)) == ["avx2"]
    lib, why = _cbuild.build("cpu_logits")
    assert lib is None and f"not an x86 CPU ({machine})" in why
    assert not any(tmp_path.rglob("*.so"))
