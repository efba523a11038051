"""kernels/_cbuild.py: where a C kernel cannot be built, it says why and leaves nothing behind."""
import pytest

from kernels import _cbuild, cpu_decode_attention, cpu_decoder, cpu_int8, cpu_layer_ops, cpu_logits


@pytest.mark.parametrize("module", [cpu_int8, cpu_decode_attention, cpu_layer_ops, cpu_logits, cpu_decoder])
def test_without_a_compiler_it_reports_why_and_does_not_build(module, monkeypatch, tmp_path):
    if module.unavailable() is not None:
        pytest.skip(f"it does not build here anyway: {module.unavailable()}")
    monkeypatch.setenv("CC", "no-such-compiler-decodelab")
    monkeypatch.setenv("DECODELAB_CACHE_DIR", str(tmp_path))
    lib, why = _cbuild.build(module.KERNEL.name)  # what the module's first use does
    assert lib is None and "no C compiler" in why
    assert not any(tmp_path.rglob("*.so"))


def test_decodelab_cpu_kernels_chooses_between_them_and_the_torch_paths(monkeypatch):
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
