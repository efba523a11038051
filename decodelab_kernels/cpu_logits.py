"""The log-sum-exp, entropy and top-n of rows of logits on x86 CPUs with AVX2 + FMA (`cpu_logits.c`), built on
first use (decodelab_kernels/_cbuild.py).

Why: a sampled row's log-probabilities, its top alternatives and its entropy cost PyTorch ~8 passes over the
vocabulary (log_softmax, topk, then exp, mask, product and sum for the entropy); at SmolLM2's 49k logits that was
~1 ms of the four-mode playground step per row kind. This is two passes. The sampler uses it where `applies()`
(engine_service/engine/sampler.py; docs/kernels.md has the measurements).
"""
from __future__ import annotations

import ctypes

import torch

from decodelab_kernels import _cbuild


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.dl_logit_stats.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr]
    lib.dl_logit_stats.restype = None


KERNEL = _cbuild.CKernel("cpu_logits", _declare)
unavailable = KERNEL.unavailable  # None if the kernel runs here, else why not
enabled = KERNEL.enabled  # whether to use it (it builds, and DECODELAB_CPU_KERNELS is not torch)


def applies(x: torch.Tensor) -> bool:
    """Whether to run it on x: our CPU kernels are enabled (_cbuild.enabled), and x is fp32 rows on the
    CPU, each row contiguous."""
    return (x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0
            and enabled())


def logit_stats(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [S, V] logits (see applies(); each row with a finite value) -> (logsumexp [S], entropy of the softmax in
    nats [S], the n largest per row: ids [S, n] int64 and their log-probabilities x - logsumexp [S, n], largest
    first)."""
    s, v = x.shape
    assert 0 <= n <= v, (n, v)
    lse, ent = torch.empty(s), torch.empty(s)
    ids, lp = torch.empty(s, n, dtype=torch.int64), torch.empty(s, n)
    if s:
        KERNEL.lib.dl_logit_stats(x.data_ptr(), x.stride(0), s, v, lse.data_ptr(), ent.data_ptr(), n,
                                  ids.data_ptr(), lp.data_ptr())
    return lse, ent, ids, lp
