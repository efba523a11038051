"""kernels/_cbuild.py: where a C kernel cannot be built, it says why and leaves nothing behind."""
import pytest

from kernels import cpu_decode_attention, cpu_int8


@pytest.mark.parametrize("module", [cpu_int8, cpu_decode_attention])
def test_without_a_compiler_it_reports_why_and_does_not_build(module, monkeypatch, tmp_path):
    if module.unavailable() is not None:
        pytest.skip(f"it does not build here anyway: {module.unavailable()}")
    monkeypatch.setenv("CC", "no-such-compiler-decodelab")
    monkeypatch.setenv("DECODELAB_CACHE_DIR", str(tmp_path))
    lib, why = module._build.__wrapped__()  # the uncached build
    assert lib is None and "no C compiler" in why
    assert not any(tmp_path.rglob("*.so"))
