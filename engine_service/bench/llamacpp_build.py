"""llama.cpp built for the CPU at hand: the anchors of `bench throughput` (single stream, through llama-cpp-python)
and `bench aggregate` (llama.cpp's own `llama-server`).

Why: llama-cpp-python 0.3.36 built by pip with its defaults (GGML_NATIVE) died with SIGILL on its first generated
token on an AMX Xeon (issue 25), so an anchor built that way measures nothing there. The fair anchor is built with
GGML_NATIVE=OFF and the ISA extensions this CPU has, named one by one from /proc/cpuinfo's flags: on an AVX-512 +
VNNI machine `-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON` on top of the AVX2
set, on an AVX2-only one (AMD Zen 3) `-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON`. AMX stays off
(the crashing path). Not x86-64 (arm64): GGML's own defaults.

Mechanism: `pip download` the llama-cpp-python sdist (no wheel: its vendored llama.cpp is the source the Python
anchor runs), extract `vendor/llama.cpp`, and `cmake --build --target llama-server` into
~/.cache/decodelab/llama.cpp/<version>-<hash of the flags>/ (reused when `build/bin/llama-server` is there). That
build also leaves libllama.so beside llama-server: llama-cpp-python loads it instead of its own when
LLAMA_CPP_LIB_PATH names that directory, which is how the single-stream anchor runs the flagged build without a
reinstall. `install_python_package` reinstalls llama-cpp-python itself with the same flags (CMAKE_ARGS).
DECODELAB_CPU_ISA=avx2 (or generic) narrows the flags as it narrows our kernels: `DECODELAB_CPU_ISA=avx2 decodelab
bench aggregate` on an AVX-512 machine runs both sides on AVX2 alone.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # pyproject.toml's `bench` extra pins the same llama-cpp-python
CACHE = Path(os.environ.get("DECODELAB_CACHE", "~/.cache/decodelab")).expanduser() / "llama.cpp"

# GGML option -> the /proc/cpuinfo flags it needs (GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw).
ISA_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("AVX", ("avx",)),
    ("AVX2", ("avx2",)),
    ("FMA", ("fma",)),
    ("F16C", ("f16c",)),
    ("AVX_VNNI", ("avx_vnni",)),
    ("AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("AVX512_VNNI", ("avx512_vnni",)),
    ("AVX512_BF16", ("avx512_bf16",)),
)
# With GGML_NATIVE=OFF these default to ON: a CPU without them must turn them off, or the build SIGILLs there.
DEFAULT_ON: tuple[tuple[str, tuple[str, ...]], ...] = (("SSE42", ("sse4_2",)), ("BMI2", ("bmi2",)))


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("anchors", help="build llama.cpp's llama-server (and optionally llama-cpp-python) "
                                             "with this CPU's GGML flags, for the llama.cpp anchors")
    p.add_argument("--install", action="store_true",
                   help="also reinstall llama-cpp-python with the same flags (CMAKE_ARGS; several minutes)")
    p.add_argument("--jobs", type=int, default=int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")))
    p.set_defaults(func=run)


def run(args) -> int:
    build = for_this_cpu()
    print(f"this CPU's flags: {build.cmake_args or '(GGML defaults)'}", flush=True)
    print(f"llama-server: {build_server(build, args.jobs)}", flush=True)
    print(f"libllama for llama-cpp-python: LLAMA_CPP_LIB_PATH={build.lib_dir}", flush=True)
    if args.install:
        print("installed: " + " ".join(install_python_package(build)), flush=True)
    return 0


def cpu_flags(cpuinfo: str) -> set[str]:
    """The ISA flags of the first CPU in a /proc/cpuinfo text (x86: `flags`, arm64: `Features`)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def ggml_flags(machine: str, flags: set[str]) -> list[str]:
    """The cmake -D options for a CPU: GGML_NATIVE=OFF and each ISA option it has; [] (GGML's defaults) off x86-64."""
    if machine.lower() not in ("x86_64", "amd64"):
        return []
    out = ["-DGGML_NATIVE=OFF"]
    for name, needs in ISA_OPTIONS:
        has = all(f in flags for f in needs)
        if has:
            out.append(f"-DGGML_{name}=ON")
        elif name in ("AVX", "AVX2", "FMA", "F16C"):  # default ON with NATIVE=OFF
            out.append(f"-DGGML_{name}=OFF")
    out += [f"-DGGML_{name}=OFF" for name, needs in DEFAULT_ON if not all(f in flags for f in needs)]
    return out


def narrowed(flags: set[str], isa: str) -> set[str]:
    """The CPU flags as our kernels see them under DECODELAB_CPU_ISA: `avx2` drops AVX-512, AVX-VNNI and AMX (an
    AMD Zen 3 as far as either side can tell), `generic` also AVX, AVX2, FMA and F16C (a CPU without AVX2). So a
    forced-fallback run compares ours against llama.cpp restricted to the same instructions."""
    if isa not in ("avx2", "generic"):
        return flags
    drop = {f for f in flags if f.startswith(("avx512", "amx")) or f == "avx_vnni"}
    if isa == "generic":
        drop |= {"avx", "avx2", "fma", "f16c"}
    return flags - drop


def this_cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    from decodelab_kernels._cbuild import cpu_isa  # DECODELAB_CPU_ISA, checked as our kernels read it

    return ggml_flags(platform.machine(), narrowed(cpu_flags(text), cpu_isa()))


@dataclass(frozen=True)
class Build:
    """One llama.cpp build: the sdist version and the GGML flags; where it lives in the cache."""

    flags: tuple[str, ...]
    version: str = VERSION
    cache: Path = CACHE

    @property
    def key(self) -> str:
        return f"{self.version}-{hashlib.sha256(' '.join(self.flags).encode()).hexdigest()[:12]}"

    @property
    def root(self) -> Path:
        return self.cache / self.key

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def lib_dir(self) -> Path:
        """Where libllama.so lands: LLAMA_CPP_LIB_PATH for llama-cpp-python."""
        return self.root / "build" / "bin"

    @property
    def cmake_args(self) -> str:
        """CMAKE_ARGS for `pip install llama-cpp-python` with the same flags."""
        return " ".join(self.flags)

    def describe(self) -> dict:
        return {"llama_cpp_python": self.version, "cmake_flags": list(self.flags) or ["(GGML defaults)"],
                "dir": str(self.root)}


def for_this_cpu() -> Build:
    return Build(tuple(this_cpu_flags()))


def cmake_commands(src: Path, build_dir: Path, flags: list[str] | tuple[str, ...], jobs: int = 2) -> list[list[str]]:
    """Configure (Release, no libcurl: the bench loads local files) and build only llama-server (and the libs)."""
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", *flags,
                 "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    build = ["cmake", "--build", str(build_dir), "--config", "Release", "--target", "llama-server", "-j", str(jobs)]
    return [configure, build]


def fetch_sdist(version: str = VERSION, cache: Path = CACHE) -> Path:
    """The llama-cpp-python sdist from PyPI (pip's own client), kept in the cache."""
    dest = cache / "sdist"
    found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(dest)], check=True)
    return next(dest.glob(f"llama_cpp_python-{version}.tar.gz"))


def extract_vendored(sdist: Path, dest: Path) -> Path:
    """vendor/llama.cpp of the sdist into `dest` (the same source llama-cpp-python compiles)."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        if not members:
            raise ValueError(f"sdist: {sdist} has no vendor/llama.cpp")
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, members=members, filter="data")
    return dest


def build_server(build: Build | None = None, jobs: int = 2) -> Path:
    """llama-server for `build` (default: this CPU's flags), built once into the cache; its path."""
    build = build or for_this_cpu()
    if build.server.is_file():
        return build.server
    src = build.root / "src"
    if not (src / "CMakeLists.txt").is_file():
        shutil.rmtree(src, ignore_errors=True)
        extract_vendored(fetch_sdist(build.version, build.cache), src)
    print(f"building llama-server {build.version} with {build.cmake_args or 'GGML defaults'} into {build.root} "
          f"(-j{jobs}: several minutes)", flush=True)
    start = time.monotonic()
    for cmd in cmake_commands(src, build.root / "build", build.flags, jobs):
        subprocess.run(cmd, check=True)
    info = {**build.describe(), "build_s": round(time.monotonic() - start, 1), "built": time.strftime("%F %T")}
    (build.root / "build.json").write_text(json.dumps(info, indent=2))
    return build.server


def install_python_package(build: Build | None = None) -> list[str]:
    """Reinstall llama-cpp-python with `build`'s flags (pip compiles it: several minutes); the command run."""
    build = build or for_this_cpu()
    import importlib.util

    cmd = [sys.executable, "-m", "pip", "install", "--no-cache-dir", f"llama-cpp-python=={build.version}"]
    if importlib.util.find_spec("llama_cpp") is not None:  # rebuild it, but leave its dependencies (numpy) be
        cmd[4:4] = ["--force-reinstall", "--no-deps"]
    env = dict(os.environ, CMAKE_ARGS=build.cmake_args)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    subprocess.run(cmd, env=env, check=True)
    return [f"CMAKE_ARGS={build.cmake_args!r}", *cmd]
