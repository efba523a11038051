"""Every decoder layer of a CPU decode step in one C call (`cpu_decoder.c`), built on first use.

The C side only sequences the calls the model's module path makes (RMSNorm, int8 matmuls, RoPE, KV store, decode
attention, SiLU x up), through pointers to the same functions in cpu_int8, cpu_layer_ops and cpu_decode_attention,
so its results are bit for bit the module path's; what it removes is ~5 ms of Python, ctypes and PyTorch
overhead per SmolLM2 step (engine_service/engine/models/fused_decode.py decides when it applies).
"""
from __future__ import annotations

import ctypes

import torch

from decodelab_kernels import _cbuild, cpu_decode_attention, cpu_int8, cpu_layer_ops

_p = ctypes.c_void_p


class Ops(ctypes.Structure):
    _fields_ = [("int8_linear", _p), ("rms_norm", _p), ("rope", _p), ("silu_mul", _p), ("store_kv", _p),
                ("paged_decode", _p)]


class MatrixPtrs(ctypes.Structure):
    _fields_ = [("packed", _p), ("steps", _p), ("offsets", _p), ("bias", _p), ("fmt", ctypes.c_int64)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", MatrixPtrs), ("o", MatrixPtrs),
                ("gate_up", MatrixPtrs), ("down", MatrixPtrs), ("k_cache", _p), ("v_cache", _p)]


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                    "intermediate", "block_size")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kv_kind", ctypes.c_int64)]


def _declare(lib: ctypes.CDLL) -> None:
    i64 = ctypes.c_int64
    lib.dl_decode_layers.argtypes = [ctypes.POINTER(Ops), ctypes.POINTER(Shape), ctypes.POINTER(Layer), _p, i64, _p,
                                     _p, _p, _p, i64, _p]
    lib.dl_decode_layers.restype = ctypes.c_int
    lib.dl_decode_step.argtypes = [ctypes.POINTER(Ops), ctypes.POINTER(Shape), ctypes.POINTER(Layer), _p, i64, _p, _p,
                                   _p, _p, i64, _p, ctypes.c_float, _p, i64, _p, _p, i64, _p]
    lib.dl_decode_step.restype = ctypes.c_int


KERNEL = _cbuild.CKernel("cpu_decoder", _declare)


def unavailable() -> str | None:
    """None if this and the three libraries it calls run here, else why not."""
    for kernel in (KERNEL, cpu_int8.kernel(), cpu_layer_ops.KERNEL, cpu_decode_attention.kernel()):
        if (why := kernel.unavailable()) is not None:
            return why
    return None


def ops(int8: _cbuild.CKernel, cache_dtype: torch.dtype = torch.float32) -> Ops:
    """The six functions the layers call, from the libraries the module path uses (`int8`: the cpu_int8 build the
    model's matrices are packed for; `cache_dtype`: the KV caches', which picks the store)."""
    def address(kernel: _cbuild.CKernel, name: str) -> int:
        return ctypes.cast(getattr(kernel.lib, name), _p).value

    return Ops(address(int8, "dl_int8_linear"), address(cpu_layer_ops.KERNEL, "dl_rms_norm"),
               address(cpu_layer_ops.KERNEL, "dl_rope"), address(cpu_layer_ops.KERNEL, "dl_silu_mul"),
               address(cpu_decode_attention.kernel(), cpu_decode_attention.STORES[cache_dtype]),
               address(cpu_decode_attention.kernel(), "dl_paged_decode"))


def matrix_ptrs(m: cpu_int8.Matrix) -> MatrixPtrs:
    return MatrixPtrs(*m._ptrs)
