"""Build and load the C kernels of this package (cpu_*.c) with the system compiler, once per source version.

Each source is compiled with `$CC` (else `cc`), -O3 -mavx2 -mfma -mf16c -fopenmp (and a build's own flags: -mavx512f
-mavx512bw for cpu_int8_avx512.c, and -mavx512vnni for cpu_int8_vnni.c; -mavx512f for cpu_decode_attention.c's
AVX-512 build), into `$DECODELAB_CACHE_DIR/kernels` (default ~/.cache/decodelab/kernels) under a name that carries a
hash of the source, the headers beside it (cpu_*.h) and the flags, built aside and renamed (processes may race).
`build()` says why not instead when the CPU lacks an instruction set the build needs (AVX2, FMA and F16C for all:
every AVX2 CPU has the other two), there is no compiler, or the build fails; callers then run their PyTorch path
(or a narrower build).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


X86 = ("x86_64", "amd64", "i386", "i686")


def is_x86() -> bool:
    """Whether this process runs x86 code: the only kind our kernels are written for."""
    return platform.machine().lower() in X86


def cpu_flags() -> set[str]:
    """The x86 ISA flags /proc/cpuinfo lists; none for a process of another architecture, whose kernels could not
    run the builds anyway (an arm64 container under QEMU on an x86 host reads the host's x86 flags there)."""
    if not is_x86():
        return set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


CPU_ISAS = ("avx2", "avx512", "generic")  # DECODELAB_CPU_ISA's values; unset or empty: what the CPU has


def cpu_isa() -> str:
    """DECODELAB_CPU_ISA, checked ("" when unset): avx2 and generic narrow every choice; avx512 (or nothing) lets
    the CPU decide, as it cannot add instructions the CPU lacks."""
    chosen = os.environ.get("DECODELAB_CPU_ISA", "").lower()
    if chosen and chosen not in CPU_ISAS:
        raise ValueError(f"DECODELAB_CPU_ISA: expected one of {', '.join(CPU_ISAS)}, got {chosen!r}")
    return chosen


def generic_cpu() -> bool:
    """DECODELAB_CPU_ISA=generic: run as on a CPU without AVX2 (arm64, old x86): none of our C kernels, no x86-only
    PyTorch paths (fbgemm); every such choice takes its PyTorch fallback. For tests and A/B runs."""
    return os.environ.get("DECODELAB_CPU_ISA", "").lower() == "generic"


def cache_dir() -> Path:
    root = os.environ.get("DECODELAB_CACHE_DIR") or Path.home() / ".cache" / "decodelab"
    return Path(root) / "kernels"


def missing(needs: tuple[str, ...]) -> list[str]:
    """The /proc/cpuinfo flags of `needs` this CPU lacks (all of them where there is no /proc/cpuinfo)."""
    have = cpu_flags()
    return [f for f in needs if f not in have]


def build(name: str, flags: tuple[str, ...] = (), needs: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str]:
    """`name`.c built (unless already in the cache) with FLAGS + `flags` and loaded: (the library, "") or
    (None, why not). `needs`: the CPU flags (/proc/cpuinfo's names) the build runs on, beyond AVX2, FMA and F16C."""
    source = Path(__file__).with_name(f"{name}.c")
    if generic_cpu():
        return None, "DECODELAB_CPU_ISA=generic: treated as a CPU without AVX2 (an arm64 one, say)"
    if not is_x86():
        return None, f"not an x86 CPU ({platform.machine()}): the kernels are written for AVX2 and AVX-512"
    if lacking := missing(("avx2", "fma", "f16c", *needs)):
        return None, f"this CPU lacks {', '.join(lacking)} (or has no /proc/cpuinfo to say so)"
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        return None, f"no C compiler (cc, or $CC) to build decodelab_kernels/{name}.c"
    argv_flags = [*FLAGS, *flags]
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    tag = hashlib.sha256(text + " ".join(argv_flags).encode()).hexdigest()[:12]
    out = cache_dir() / f"{name}-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            argv = [cc, *argv_flags, "-o", tmp, str(source), "-lm"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                return None, f"building decodelab_kernels/{name}.c failed: {done.stderr.strip()[:300]}"
            os.replace(tmp, out)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building decodelab_kernels/{name}.c failed: {e}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    torch.get_num_threads()  # PyTorch's libgomp is loaded first, so the library's OpenMP calls resolve to it
    try:
        return ctypes.CDLL(str(out)), ""
    except OSError as e:
        return None, f"loading {out.name} failed: {e}"


def enabled(why_not: str | None) -> bool:
    """Whether the engine runs our AVX2 kernels for attention and the layer ops (cpu_decode_attention,
    cpu_layer_ops): where they build (`why_not` is None), unless DECODELAB_CPU_KERNELS=torch asks for the PyTorch
    paths; DECODELAB_CPU_KERNELS=avx2 insists (an error where they do not build)."""
    forced = os.environ.get("DECODELAB_CPU_KERNELS", "")
    if forced not in ("", "avx2", "torch"):
        raise ValueError(f"DECODELAB_CPU_KERNELS: expected avx2 or torch, got {forced!r}")
    if forced == "avx2" and why_not is not None:
        raise ValueError(f"DECODELAB_CPU_KERNELS: avx2 does not run here ({why_not})")
    return forced != "torch" and why_not is None


class CKernel:
    """One cpu_*.c library, built and loaded on first use, its functions declared (argtypes) by `declare`."""

    def __init__(self, name: str, declare: Callable[[ctypes.CDLL], None], flags: tuple[str, ...] = (),
                 needs: tuple[str, ...] = (), probe: Callable[[ctypes.CDLL], str | None] | None = None):
        """`probe`, if given, runs once on the loaded library: None where it may run in this process, else why not
        (AMX: the kernel must grant the tiles' state first)."""
        self.name, self._declare, self.flags, self.needs, self._probe = name, declare, flags, needs, probe

    @functools.cached_property
    def _loaded(self) -> tuple[ctypes.CDLL | None, str]:
        lib, why = build(self.name, self.flags, self.needs)
        if lib is not None:
            self._declare(lib)
            if self._probe is not None and (refused := self._probe(lib)) is not None:
                return None, refused
        return lib, why

    @property
    def lib(self) -> ctypes.CDLL:
        lib, why = self._loaded
        if lib is None:
            raise RuntimeError(f"decodelab_kernels/{self.name}.c is not available: {why}")
        return lib

    def unavailable(self) -> str | None:
        """None if the kernel runs here, else why not."""
        return None if self._loaded[0] is not None else self._loaded[1]

    @functools.cached_property
    def _enabled(self) -> bool:
        return enabled(self.unavailable())

    def enabled(self) -> bool:
        """enabled(self.unavailable()), read once."""
        return self._enabled
