"""int8 weight x fp32 activation matmul for x86 CPUs with AVX2 + FMA (`cpu_int8.c`), built on first use.

Why our own kernel: for the 1-8 rows of a decode step PyTorch's choices were either slow or lossy on the
2-core AVX2 target. fbgemm's int8 path quantizes the activations too (8 bits on a fixed grid, weights limited to
7 bits by AVX2's int16 pair sums), which needs SmoothQuant and fp16 weights for down_proj and the LM head to
stay within 2% perplexity, and pays ~60 us of its own per call at one row; `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` have no fast AVX2 path (2-65x and ~10x slower than fp32). This kernel keeps
the activations in fp32 (weight-only int8, 8 bits, one scale per output row: exact products, nothing to
calibrate) and reads each weight byte once per block of up to 4 rows (docs/kernels.md has the measurements).

The first call (`unavailable()` or `linear()`) compiles `cpu_int8.c` with the system C compiler (`$CC`, else
`cc`; -O3 -mavx2 -mfma -fopenmp) into `$DECODELAB_CACHE_DIR/kernels` (default ~/.cache/decodelab/kernels), once
per source version. `unavailable()` says why not when the CPU lacks AVX2 or FMA, there is no compiler, or the
build fails: callers (int8_linear.int8_kernel) then fall back to PyTorch's kernels.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_int8.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    root = os.environ.get("DECODELAB_CACHE_DIR") or Path.home() / ".cache" / "decodelab"
    return Path(root) / "kernels"


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not)."""
    if not {"avx2", "fma"} <= _cpu_flags():
        return None, "this CPU has no AVX2 + FMA (or no /proc/cpuinfo to say so)"
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        return None, "no C compiler (cc, or $CC) to build kernels/cpu_int8.c"
    text = SOURCE.read_bytes()
    tag = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:12]
    out = _cache_dir() / f"cpu_int8-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # built aside, then renamed: processes may race
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                return None, f"building kernels/cpu_int8.c failed: {done.stderr.strip()[:300]}"
            os.replace(tmp, out)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building kernels/cpu_int8.c failed: {e}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    torch.get_num_threads()  # PyTorch's libgomp is loaded first, so the library's OpenMP calls resolve to it
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as e:
        return None, f"loading {out.name} failed: {e}"
    f = lib.dl_int8_linear
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    f.restype = None
    return lib, ""


def unavailable() -> str | None:
    """None if the kernel runs here, else why not."""
    lib, why = _build()
    return None if lib is not None else why


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 (CPU) @ q [N, K] int8 (contiguous), times scale [N] fp32, plus bias [N] fp32 -> [M, N] fp32."""
    lib, why = _build()
    if lib is None:
        raise RuntimeError(f"kernels.cpu_int8 is not available: {why}")
    assert q.dtype == torch.int8 and q.is_contiguous() and scale.dtype == torch.float32 and scale.is_contiguous()
    assert x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[1] == q.shape[1]
    x = x.contiguous()
    out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    if x.shape[0]:
        lib.dl_int8_linear(x.data_ptr(), x.shape[0], q.shape[1], q.data_ptr(), scale.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(), q.shape[0])
    return out
