"""A CPU decode step's model body in one C call (decodelab_kernels/cpu_decoder.c), for int8 models on our kernel.

At the few rows of a decode step the module path spends ~5 ms of a SmolLM2 step (2-core AVX2 target) in Python,
ctypes and PyTorch bookkeeping around its ~10 C calls per layer. `FusedDecode` hands the embedding, the whole layer
stack and the final norm to one C call that makes the same calls into the same libraries (and copies the same table
rows), so the numbers are bit for bit the module path's (tested). It runs a step when:
- the model is on the CPU in fp32 with every decoder matmul on our int8 kernel for generated rows (`--quantization
  int8`, where decodelab_kernels/cpu_int8.c builds; `RowSplitWeight` or `Int8Weight("avx2" or "avx512")`), all of one
build; - the C layer ops and decode attention are enabled (not DECODELAB_CPU_KERNELS=torch) and take the model's shapes,
  over an fp32 or fp16 KV cache;
- every row of the step is a generated token laid out as a decode row (`AttentionMetadata.num_generated` and
  `num_decode` equal the rows; ModelRunner.prepare does so for decoding and speculative verification), none of
  them padding.
Anything else (prefill, prompt chunks, an int8 KV cache, fp32 weights) runs the module path.
"""
from __future__ import annotations

import ctypes

import torch

from decodelab_kernels import cpu_decode_attention, cpu_decoder, cpu_layer_ops
from engine_service.engine.attention import AttentionMetadata
from engine_service.engine.models.int8_linear import Int8Weight, RowSplitWeight


def kernels_missing() -> str | None:
    """Why the one-call stack cannot run on this machine at all (its library, or the C ops it calls), or None."""
    if (why := cpu_decoder.unavailable()) is not None:
        return f"no C kernels here: {why}"
    if not (cpu_layer_ops.enabled() and cpu_decode_attention.enabled()):
        return "the C layer ops are off (DECODELAB_CPU_KERNELS=torch, or they do not build)"
    return None


def _generated_matrix(linear):
    """The cpu_int8.Matrix a Linear multiplies generated rows by, or None."""
    w = getattr(linear, "int8", None)
    if isinstance(w, RowSplitWeight):
        w = w.generated
    return w.matrix if isinstance(w, Int8Weight) else None


class FusedDecode:
    """The pointers the C call needs, gathered once; `run(x, cos, sin, meta)` is the layer stack."""

    def __init__(self, model, layers: list, matrices: list[tuple]):
        first = model.layers[0]
        attn = first.self_attn
        # the attention modules themselves: current() runs every step, and each `layer.self_attn` is a
        # Module.__getattr__ lookup (~0.1 ms a step over 30 layers)
        self.attns = [layer.self_attn for layer in model.layers]
        self.caches = [(a.k_cache, a.v_cache) for a in self.attns]
        self.shape = cpu_decoder.Shape(len(layers), model.config.hidden_size, attn.num_heads, attn.num_kv_heads,
                                       attn.head_dim, model.config.intermediate_size, attn.k_cache.shape[1],
                                       first.input_layernorm.eps, attn.attn.scale,
                                       cpu_decode_attention.KV_KINDS[attn.k_cache.dtype])
        self.structs = (cpu_decoder.Layer * len(layers))(*layers)
        self.ops = cpu_decoder.ops(matrices[0][0].kernel, attn.k_cache.dtype)
        self._keep = matrices  # the Matrix objects whose memory the structs point into
        # what CausalLM.forward reads around the layers: the embedding table, RoPE's tables (the sine signed once
        # here, as forward signs its rows each step), the final norm
        self.embed, self.norm = model.embed_tokens.weight, model.norm
        self.cos_table, self.sin_table = model.cos, model.sin
        half = model.sin.shape[-1] // 2
        self.ssin_table = torch.cat([-model.sin[:, :half], model.sin[:, half:]], dim=-1).contiguous()

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        """The plan for `model` as it is now (weights quantized, caches bound), or None where it cannot run."""
        if kernels_missing() is not None:
            return None
        if model.config.model_type not in ("llama", "qwen2"):
            return None
        tables = (model.embed_tokens.weight, model.cos, model.sin, model.norm.weight)
        if not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tables) or model.cos.dim() != 2:
            return None
        layers, matrices = [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            ms = [_generated_matrix(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            caches = (attn.k_cache, attn.v_cache)
            if any(m is None for m in ms) or any(c is None for c in caches):
                return None
            build = matrices[0][0].kernel if matrices else ms[0].kernel
            if any(m.kernel is not build for m in ms):
                return None  # one C call, one build of cpu_int8 (each packs for its own blocks)
            if not (attn.attn.torch_backend and attn.attn.k_scale is None and attn.head_dim % 2 == 0
                    # a float cache the C stack stores into (an int8 cache's rows are quantized on the module path)
                    and all(c.dtype in cpu_decode_attention.STORES and c.dtype == caches[0].dtype and c.is_cpu
                            and c.is_contiguous() for c in caches)
                    and cpu_decode_attention.supports(torch.empty(1, attn.num_heads, attn.head_dim), attn.k_cache)):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(w.dtype == torch.float32 and w.is_contiguous() and w.is_cpu for w in norms):
                return None
            layers.append(cpu_decoder.Layer(norms[0].data_ptr(), norms[1].data_ptr(),
                                            *(cpu_decoder.matrix_ptrs(m) for m in ms),
                                            caches[0].data_ptr(), caches[1].data_ptr()))
            matrices.append(tuple(ms))
        return cls(model, layers, matrices)

    def current(self, model) -> bool:
        """Whether the tensors the plan points into are still the model's (the model runner binds the caches and
        RoPE's tables once)."""
        return (model.embed_tokens.weight is self.embed and model.cos is self.cos_table and model.sin is self.sin_table
                and model.norm is self.norm
                and all(a.k_cache is k and a.v_cache is v for a, (k, v) in zip(self.attns, self.caches)))

    @staticmethod
    def applies(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one the C call takes: rows on the CPU, all of them generated decode rows."""
        m = input_ids.shape[0]
        return (m > 0 and input_ids.is_cpu and meta.num_decode == m and meta.num_generated == m
                and meta.store_slots()[1] is None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states [M, hidden]: what CausalLM.forward returns for these rows (the embedding,
        every layer, the final norm), bit for bit."""
        ids, pos = input_ids.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        slots = meta.store_slots()[0].contiguous()
        bt, ldbt, lens = meta.decode_tables()._tables
        m, (vocab, hidden) = ids.shape[0], self.embed.shape
        out = torch.empty(m, hidden)
        err = cpu_decoder.KERNEL.lib.dl_decode_step(
            ctypes.byref(self.ops), ctypes.byref(self.shape), self.structs, self.embed.data_ptr(), vocab,
            ids.data_ptr(), pos.data_ptr(), self.cos_table.data_ptr(), self.ssin_table.data_ptr(),
            self.cos_table.shape[0], self.norm.weight.data_ptr(), self.norm.eps, out.data_ptr(), m, slots.data_ptr(),
            bt, ldbt, lens)
        if err == -2:
            raise IndexError("cpu_decoder: a token id or position out of its table")
        if err:
            raise MemoryError("cpu_decoder: no memory for a decode step's activations")
        return out
