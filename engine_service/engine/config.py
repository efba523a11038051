import os
from dataclasses import dataclass


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" where a GPU is visible, else "cpu"; any other name as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str | None = None  # default: float32 on CPU (no fast bf16 matmul there), bfloat16 on CUDA
    device: str = "auto"  # "auto" picks cuda when a GPU is visible
    block_size: int = 16
    # KV pool budget: bytes (> 1) or a fraction of free memory (<= 1)
    kv_cache_memory: float = 0.25
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests use it to force preemption)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # "torch" | "triton"; default from env, else by device
    enforce_eager: bool = False  # no CUDA graphs for decode steps (they need CUDA and the triton backend)
    max_beam_width: int = 8
    draft_model: str | None = None
    cache_dir: str | None = None
    num_threads: int | None = None
    seed: int = 0
    # "int8": int8 weights, dynamically quantized activations (int8_linear.py); "none" (a flag's way to ask for
    # the float weights where a command defaults to int8) is None
    quantization: str | None = None
    # "auto": the model dtype, except fp16 under int8 weights on a CPU (below); "fp32" / "fp16": K/V in that float
    # type; "int8": int8 K/V, per-(token, head) scales (kv_int8.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.attention_backend is None:
            default = "triton" if self.device.startswith("cuda") else "torch"
            self.attention_backend = os.environ.get("DECODELAB_ATTENTION_BACKEND", default)
        if self.attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend: expected 'torch' or 'triton', got {self.attention_backend!r}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype: expected float32, float16 or bfloat16, got {self.dtype!r}")
        if self.quantization == "none":
            self.quantization = None
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization: expected 'int8' or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp32", "fp16", "int8"):
            raise ValueError(f"kv_cache_dtype: expected 'auto', 'fp32', 'fp16' or 'int8', got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "auto" and self.quantization == "int8" and self.device == "cpu" \
                and self.dtype == "float32":
            # int8 weights already move the log-probs by ~0.01 nats; an fp16 cache adds ~0.001 (bench quality) and
            # halves what a decode step's attention reads, most of a 128-row step on a CPU (llama.cpp's default
            # cache is f16 too). The float weights keep the model's dtype: token-exact with Hugging Face.
            self.kv_cache_dtype = "fp16"
        if self.kv_cache_dtype == "fp32" and self.dtype != "float32":
            raise ValueError(f"kv_cache_dtype 'fp32' is for float32 models (this one is {self.dtype})")
        if self.kv_cache_dtype == "fp16" and self.attention_backend == "triton" and self.dtype != "float16":
            raise ValueError("kv_cache_dtype 'fp16' under a float32 or bfloat16 model runs on the torch attention "
                             "backend only (the Triton kernels read caches of the model's dtype)")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device: expected cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be bytes (> 1) or a fraction (<= 1) of free memory, "
                             f"got {self.kv_cache_memory}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_beam_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):  # None: the default
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (or unset), got {getattr(self, name)}")
