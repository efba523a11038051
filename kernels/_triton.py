# Triton is an optional dependency: without it the modules still import (the torch paths work) and the
# *_triton functions fail with a clear message.
import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _Missing:
        constexpr = None  # kernel signatures annotate with tl.constexpr at definition time

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _Missing()

# Read once, as triton.jit does when the kernels are decorated: under the interpreter (CPU tests)
# tl.dot gives wrong results for bf16 inputs, so the kernels upcast bf16 tiles to fp32 there.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton() -> None:
    assert HAS_TRITON, "triton is not installed: use the *_torch kernels (pip install decodelab[triton])"


def dot_upcast(dtype: torch.dtype) -> bool:
    return INTERPRET and dtype == torch.bfloat16
