"""The llama.cpp anchors of issue 25 (engine_service/bench/llamacpp_build.py, llamacpp.py): the GGML flags picked
from a CPU's /proc/cpuinfo, the cmake command line, the SIGILL of a build for the wrong ISA caught in a real child
process and answered with the flagged build. Nothing here builds llama.cpp."""
import io
import signal
import subprocess
import sys
import tarfile
import textwrap

import pytest

from engine_service.bench import llamacpp, llamacpp_build
from engine_service.bench.llamacpp_build import Build, cmake_commands, cpu_flags, ggml_flags, narrowed

# /proc/cpuinfo `flags` lines as the machines print them (trimmed to the ISA part)
ZEN3 = ("flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 "
        "bmi2 sha_ni vaes vpclmulqdq")
SAPPHIRE_RAPIDS = ("flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512cd "
                   "avx512bw avx512vl avx512_vnni avx512_bf16 avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8")
SKYLAKE_X = "flags\t\t: sse sse2 sse4_2 avx f16c fma avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl"
SANDY_BRIDGE = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt aes xsave avx"
ARM64 = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp"


def test_an_avx2_only_cpu_gets_the_avx2_set():
    assert ggml_flags("x86_64", cpu_flags(ZEN3)) == [
        "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]


def test_an_avx512_vnni_amx_cpu_gets_the_avx512_set_and_no_amx():
    flags = ggml_flags("x86_64", cpu_flags(SAPPHIRE_RAPIDS))
    assert flags == ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                     "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"]
    assert not any("AMX" in f for f in flags)  # pip's default build, with AMX, is the one that died of SIGILL


def test_avx512_without_vnni_or_bf16_leaves_those_out():
    flags = ggml_flags("x86_64", cpu_flags(SKYLAKE_X))
    assert "-DGGML_AVX512=ON" in flags
    assert not any("VNNI" in f or "BF16" in f for f in flags)


def test_an_older_x86_cpu_turns_off_what_ggml_would_otherwise_assume():
    flags = ggml_flags("x86_64", cpu_flags(SANDY_BRIDGE))
    assert "-DGGML_AVX=ON" in flags
    for off in ("AVX2", "FMA", "F16C", "BMI2"):  # default ON with GGML_NATIVE=OFF: would SIGILL here
        assert f"-DGGML_{off}=OFF" in flags


def test_forcing_avx2_builds_the_anchor_an_avx2_only_cpu_would_get():
    # DECODELAB_CPU_ISA=avx2 on a Sapphire Rapids: llama.cpp loses AVX-512, AVX-VNNI and AMX as our kernels do
    assert ggml_flags("x86_64", narrowed(cpu_flags(SAPPHIRE_RAPIDS), "avx2")) == ggml_flags(
        "x86_64", narrowed(cpu_flags(ZEN3), "avx2")) == ggml_flags("x86_64", cpu_flags(ZEN3))
    generic = ggml_flags("x86_64", narrowed(cpu_flags(SAPPHIRE_RAPIDS), "generic"))
    for off in ("AVX", "AVX2", "FMA", "F16C"):
        assert f"-DGGML_{off}=OFF" in generic
    assert narrowed(cpu_flags(SAPPHIRE_RAPIDS), "") == narrowed(cpu_flags(SAPPHIRE_RAPIDS), "avx512") == cpu_flags(
        SAPPHIRE_RAPIDS)


def test_the_anchor_build_follows_decodelab_cpu_isa(monkeypatch):
    monkeypatch.setenv("DECODELAB_CPU_ISA", "avx2")
    flags = llamacpp_build.this_cpu_flags()
    assert not any("AVX512" in f or "VNNI" in f for f in flags)


def test_arm64_keeps_ggml_defaults():
    assert cpu_flags(ARM64) >= {"asimd", "asimddp"}
    assert ggml_flags("aarch64", cpu_flags(ARM64)) == []


def test_each_flag_set_has_its_own_cache_directory():
    zen3, spr = Build(tuple(ggml_flags("x86_64", cpu_flags(ZEN3)))), Build(tuple(ggml_flags("x86_64",
                                                                                          cpu_flags(SAPPHIRE_RAPIDS))))
    assert zen3.key != spr.key and zen3.key.startswith(f"{llamacpp_build.VERSION}-")
    assert zen3.key == Build(zen3.flags).key  # stable: a second run reuses the build
    assert zen3.server == zen3.root / "build" / "bin" / "llama-server"
    assert zen3.cmake_args == "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"


def test_the_cmake_commands_build_only_llama_server_release_without_curl(tmp_path):
    flags = ggml_flags("x86_64", cpu_flags(ZEN3))
    configure, build = cmake_commands(tmp_path / "src", tmp_path / "build", flags, jobs=2)
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    assert "-DCMAKE_BUILD_TYPE=Release" in configure and "-DLLAMA_CURL=OFF" in configure
    assert configure[configure.index("-DCMAKE_BUILD_TYPE=Release") + 1:][:len(flags)] == flags
    assert build == ["cmake", "--build", str(tmp_path / "build"), "--config", "Release", "--target", "llama-server",
                     "-j", "2"]


def test_only_the_vendored_llama_cpp_is_extracted_from_the_sdist(tmp_path):
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in (("llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt", b"project(llama)"),
                           ("llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/ggml.c", b"int x;"),
                           ("llama_cpp_python-0.3.36/llama_cpp/__init__.py", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    src = llamacpp_build.extract_vendored(sdist, tmp_path / "src")
    assert (src / "CMakeLists.txt").read_text() == "project(llama)" and (src / "ggml" / "ggml.c").is_file()
    assert not (src / "llama_cpp").exists()


def test_a_child_killed_by_sigill_is_told_from_other_failures():
    killed = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    assert killed.returncode == -signal.SIGILL and llamacpp.died_of_sigill(killed.returncode)
    via_shell = subprocess.run(["sh", "-c", f"{sys.executable} -c 'import os, signal; "
                                            "os.kill(os.getpid(), signal.SIGILL)'; exit $?"])
    assert via_shell.returncode == 132 and llamacpp.died_of_sigill(via_shell.returncode)
    assert not llamacpp.died_of_sigill(subprocess.run([sys.executable, "-c", "raise SystemExit(1)"]).returncode)
    assert not llamacpp.died_of_sigill(0)


# A stand-in llama_cpp for the child process: it dies of SIGILL on its first token unless LLAMA_CPP_LIB_PATH names
# a library directory, as pip's default build did on the AMX Xeon and the flagged build did not.
FAKE_LLAMA_CPP = textwrap.dedent('''
    import os, signal
    __version__ = "0.3.36"

    def llama_print_system_info():
        return b"CPU : AVX2 = 1 | lib = " + os.environ.get("LLAMA_CPP_LIB_PATH", "default").encode()

    class Llama:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def generate(self, prompt, **kwargs):
            if "LLAMA_CPP_LIB_PATH" not in os.environ:
                os.kill(os.getpid(), signal.SIGILL)
            while True:
                yield 42

        def close(self):
            pass
''')


def test_a_default_build_that_dies_of_sigill_is_replaced_by_the_flagged_build(tmp_path, monkeypatch):
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'fake'}:{':'.join(sys.path)}")
    flagged = Build(("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"), cache=tmp_path / "cache")
    flagged.server.parent.mkdir(parents=True)
    flagged.server.write_text("")  # as if built: nothing compiles here
    monkeypatch.setattr(llamacpp_build, "for_this_cpu", lambda: flagged)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    row = llamacpp.single_stream(str(gguf), threads=1, prompt_len=4, new_tokens=5, runs=2)
    assert row["default_build_crashed"] == f"SIGILL (exit {-signal.SIGILL})"
    assert row["build"]["lib"] == str(flagged.lib_dir / "libllama.so")
    assert row["build"]["cmake_flags"] == ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"]
    assert row["system_info"].endswith(str(flagged.lib_dir)) and row["tok_per_s"] > 0


def test_without_a_flagged_build_and_no_building_the_row_says_how_to_get_one(tmp_path, monkeypatch):
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'fake'}:{':'.join(sys.path)}")
    monkeypatch.setattr(llamacpp_build, "for_this_cpu", lambda: Build(("-DGGML_NATIVE=OFF",), cache=tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    row = llamacpp.single_stream(str(gguf), threads=1, prompt_len=4, new_tokens=3, runs=1, build_on_crash=False)
    assert "decodelab bench anchors" in row["skipped"] and row["default_build_crashed"].startswith("SIGILL")


@pytest.mark.skipif(llamacpp.installed(), reason="llama-cpp-python is installed here")
def test_a_child_that_fails_otherwise_is_skipped_with_its_error(tmp_path):
    row = llamacpp.run_child({"gguf": str(tmp_path / "m.gguf"), "threads": 1, "prompt_len": 4, "new_tokens": 3,
                              "runs": 1}, lib_dir=None)
    assert row["skipped"].startswith("llama.cpp child exited 1") and "llama_cpp" in row["skipped"]


def test_a_figure_taken_with_a_fallback_forced_says_so(monkeypatch):
    from engine_service.bench.common import FALLBACK_SWITCHES, cpu_info

    for name in FALLBACK_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert cpu_info()["forced"] == {} and "forced" not in cpu_info()["label"]
    monkeypatch.setenv("DECODELAB_CPU_ISA", "avx2")
    info = cpu_info()
    assert info["forced"] == {"DECODELAB_CPU_ISA": "avx2"}
    assert info["label"].endswith("forced DECODELAB_CPU_ISA=avx2")
    assert info["int8_isa"] in ("avx2", None) and info["attention_isa"] in ("avx2", None)  # the builds that ran
