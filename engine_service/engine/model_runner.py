"""Owns the model and the KV pool; turns a ScheduledBatch into tensors and runs one forward."""
import math
import mmap
import os

import numpy as np
import torch

import decodelab_kernels as kernels
from engine_service.engine.attention import AttentionMetadata
from engine_service.engine.config import EngineConfig
from engine_service.engine.cuda_graphs import decode_graphs_for
from engine_service.engine.models.int8_linear import CALIBRATION_TEXT, int8_kernel
from engine_service.engine.models.llama import CausalLM
from engine_service.engine.models.loader import head_dim, load_config, load_tokenizer, load_weights, max_model_len
from engine_service.engine.models.packed_linear import packing_enabled
from engine_service.engine.scheduler import ScheduledBatch
from engine_service.engine.sequence import Sequence
from engine_service.engine.utils import cdiv

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# On a CPU, prompt chunks of up to this many tokens attend as decode rows, as chunks of generated tokens always do
# (ModelRunner.prepare); longer prompt chunks keep the prefill path's one SDPA per chunk.
DECODE_ROWS_MAX = 16


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape); on a CPU from a fresh anonymous mapping, which the OS zeroes page by page on first touch,
    instead of writing every byte now: torch.zeros of the default KV pool took ~3.8 s of a replica's start on the
    2-core box, and blocks never used cost no RAM.

    On Linux the mapping asks for transparent huge pages (MADV_HUGEPAGE; where THP is "madvise", the usual default,
    only such memory gets them). Decode attention reads K/V rows scattered over the whole pool, one 4 KiB page
    after another: a step of 128 sequences x 256 tokens took 181-186 ms on 4 KiB pages and 171-177 ms on 2 MiB ones
    (int8, 2 threads, AMD Zen 5). The cost: memory is then taken 2 MiB at a time as blocks are first used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # (the tensor keeps the mapping alive)


def _fault_in_first_blocks(pool: torch.Tensor, nbytes: int = 2 << 20) -> None:
    """Write the first `nbytes` of blocks of every (layer, K/V) slab of a lazy_zeros pool now, at start.

    Blocks are handed out from id 0 up, so the first request writes the first block of each of the 2 x layers slabs:
    as many page faults, each a fresh 2 MiB page. On the 2-core AMD EPYC's VM, where memory the guest has not used
    yet is slow to fault in, the first request after a start took 384-562 ms instead of 16-23 (SmolLM2, 1 token
    out), 0.35 s of it here; the pool's other blocks stay untouched until used."""
    if pool.device.type != "cpu":
        return
    per_block = pool[0, 0, 0].numel() * pool.element_size()
    pool[:, :, :cdiv(nbytes, per_block)].zero_()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.hf_config = load_config(model_dir)
        self.max_model_len = max_model_len(self.hf_config, config.max_model_len)
        torch.manual_seed(config.seed)
        with torch.device("meta"):
            model = CausalLM(self.hf_config, config.attention_backend)
        model = model.to_empty(device=self.device)
        model.cos, model.sin = _rope_buffers(model, self.hf_config)
        model.load_hf_weights(load_weights(model_dir))
        self.model = model.to(self.dtype).eval()
        if config.quantization == "int8":
            kernel = int8_kernel(self.device)  # int8 activations need the calibration; weight-only int8 does not
            self.model.quantize_int8(kernel, self._calibration_absmax(model_dir) if kernel == "fbgemm" else None)
        elif packing_enabled(self.device, self.dtype):
            self.model.pack_linears()
        self.num_blocks = config.num_kv_blocks or self._blocks_from_budget()
        self.kv_cache = self._allocate_kv_cache(self.num_blocks)
        self.graphs = decode_graphs_for(self)  # CUDA graphs for decode-only steps; None on CPU / enforce_eager

    def _calibration_absmax(self, model_dir) -> dict:
        """Per-channel max |input| of every decoder matmul over CALIBRATION_TEXT, one prefill in a scratch
        KV pool (the real pool is sized once quantization has freed the float weights)."""
        ids = load_tokenizer(model_dir)(CALIBRATION_TEXT).input_ids[:self.max_model_len]
        self.kv_cache = self._allocate_kv_cache(cdiv(len(ids), self.config.block_size))
        return self.model.input_absmax(*self.prefill_inputs(ids))

    def prefill_inputs(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Model inputs for one sequence's whole prompt in KV blocks 0, 1, ... of the current pool."""
        n, dev, i32 = len(ids), self.device, torch.int32
        num_blocks = cdiv(n, self.config.block_size)
        assert num_blocks <= self.kv_cache.shape[2]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=dev), num_decode=0, decode_block_tables=None,
            decode_context_lens=None, prefill_cu_seqlens_q=torch.tensor([0, n], dtype=i32, device=dev),
            prefill_context_lens=torch.tensor([n], dtype=i32, device=dev),
            prefill_block_tables=torch.arange(num_blocks, dtype=i32, device=dev)[None])
        return torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta

    # ---- KV pool
    def kv_bytes_per_block(self) -> int:
        c = self.hf_config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        values = 2 * c.num_hidden_layers * self.config.block_size * c.num_key_value_heads * head_dim(c) * elem
        scales = 2 * c.num_hidden_layers * self.config.block_size * c.num_key_value_heads * 4 \
            if self.kv_dtype == torch.int8 else 0
        return values + scales  # int8: 4D / (D + 4) the blocks of fp32 in the same budget (3.76x at D 64)

    @property
    def kv_dtype(self) -> torch.dtype:
        kinds = {"int8": torch.int8, "fp16": torch.float16, "fp32": torch.float32}
        return kinds.get(self.config.kv_cache_dtype, self.dtype)

    def _blocks_from_budget(self) -> int:
        budget = self.config.kv_cache_memory
        if budget <= 1:
            free = (torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda"
                    else available_memory_bytes())
            budget = budget * free
        # more blocks than every seat filled to the model's context can never be used
        ceiling = self.config.max_num_seqs * cdiv(self.max_model_len, self.config.block_size)
        return max(1, min(ceiling, int(budget // self.kv_bytes_per_block())))

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        c = self.hf_config
        # zeros, not empty: masked-out slots are multiplied by 0 and must not hold NaN
        kv = lazy_zeros((c.num_hidden_layers, 2, num_blocks, self.config.block_size, c.num_key_value_heads,
                         head_dim(c)), self.kv_dtype, self.device)
        # int8: one fp32 scale per (layer, K/V, block, slot, KV head), decodelab_kernels/kv_int8.py; copied with its
        # block
        self.kv_scales = (lazy_zeros((c.num_hidden_layers, 2, num_blocks, self.config.block_size,
                                      c.num_key_value_heads), torch.float32, self.device)
                          if self.kv_dtype == torch.int8 else None)
        _fault_in_first_blocks(kv)
        if self.kv_scales is not None:
            _fault_in_first_blocks(self.kv_scales)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv[i, 0], kv[i, 1]
            if self.kv_scales is not None:
                layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale = self.kv_scales[i, 0], self.kv_scales[i, 1]
        return kv

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = (torch.tensor(x, dtype=torch.int64, device=self.device) for x in zip(*copies))
        fn = kernels.copy_blocks_triton if self.config.attention_backend == "triton" else kernels.copy_blocks_torch
        fn(self.kv_cache, src, dst, self.kv_scales)

    # ---- one step
    def _tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Decode-shaped sequences first, then the multi-token chunks. On a CPU, chunks of generated tokens
        (decoding, speculative verification) and prompt chunks of up to DECODE_ROWS_MAX tokens are decode-shaped:
        each token a decode row with its own context length, all over the sequence's block table (the step
        stores the chunk's K/V before attending, so row i sees the chunk up to itself). A verified token then goes
        through the same attention kernel as one decoded alone, and a few rows skip the prefill path's per-layer
        setup. Generated tokens come first (AttentionMetadata.num_generated): an int8 model on fbgemm multiplies
        their rows with another kernel than prompt rows (int8_linear.RowSplitWeight), so a token's kernel depends
        on what it is, not on how its step was cut (prefix caching, chunked prefill).
        Returns the flat inputs, the metadata and, per scheduled sequence (in batch order), the row of
        its chunk's last token in the flat batch (a chunk's tokens are contiguous there)."""
        bs, cpu = self.config.block_size, self.device.type == "cpu"

        def generated(i: int) -> bool:  # a chunk of generated tokens (a preempted sequence's recompute is not)
            return batch.seqs[i].num_computed_tokens >= batch.seqs[i].num_prompt_tokens

        def decode_shaped(i: int) -> bool:
            n = batch.num_new_tokens[i]
            return n == 1 or (cpu and (n <= DECODE_ROWS_MAX or generated(i)))

        order = sorted(range(len(batch)), key=lambda i: (not decode_shaped(i), not (cpu and generated(i))))
        ids, pos, slots, end_row = [], [], [], [-1] * len(batch)
        cu, ctx, decode_seqs, decode_ctx, prefill_seqs = [0], [], [], [], []
        num_generated = 0
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            end_row[i] = len(ids) - 1
            if decode_shaped(i):
                decode_seqs += [seq] * n
                decode_ctx += range(start + 1, start + n + 1)
                if cpu and generated(i):
                    num_generated += n
            else:
                cu.append(cu[-1] + n)
                ctx.append(start + n)
                prefill_seqs.append(seq)
        num_decode = len(decode_ctx)
        dev, i32 = self.device, torch.int32
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode=num_decode,
            num_generated=num_generated,
            decode_block_tables=self._tables(decode_seqs) if num_decode else None,
            decode_context_lens=torch.tensor(decode_ctx, dtype=i32, device=dev) if num_decode else None,
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=i32, device=dev) if prefill_seqs else None,
            prefill_context_lens=torch.tensor(ctx, dtype=i32, device=dev) if prefill_seqs else None,
            prefill_block_tables=self._tables(prefill_seqs) if prefill_seqs else None,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return input_ids, positions, meta, end_row

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the flat batch: a captured CUDA graph when one fits, else the eager model."""
        if self.graphs is not None and self.graphs.fits(input_ids.shape[0], meta):
            return self.graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, num_rows: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Runs the batch. Sequence i gets the logits (float32) of the last num_rows[i] tokens of its chunk
        (by default 1 when the chunk reaches its last token, else 0: the row it samples from); speculative
        verification and prompt log-probs ask for more. Returns the logits and, per scheduled sequence, the
        index of its first row in them (-1 when it gets none)."""
        self.copy_blocks(batch.copies)
        input_ids, positions, meta, end_row = self.prepare(batch)
        hidden = self.forward(input_ids, positions, meta)
        if num_rows is None:
            num_rows = [int(s.num_computed_tokens + n == s.num_tokens)
                        for s, n in zip(batch.seqs, batch.num_new_tokens)]
        rows, index = [], []
        for r, k in zip(end_row, num_rows):
            index.append(len(rows) if k else -1)
            rows.extend(range(r - k + 1, r + 1))
        logits = self.model.compute_logits(hidden[rows]) if rows else hidden.new_empty(0, 0).float()
        return logits, index


def _rope_buffers(model: CausalLM, hf_config) -> tuple[torch.Tensor, torch.Tensor]:
    from engine_service.engine.models.llama import rope_tables

    cos, sin = rope_tables(hf_config, hf_config.max_position_embeddings)
    return cos.to(model.embed_tokens.weight.device), sin.to(model.embed_tokens.weight.device)


def set_threads(num_threads: int | None) -> None:
    """Keep torch from oversubscribing the cores it shares with Redis, the web UI, a browser."""
    n = num_threads or int(os.environ.get("DECODELAB_NUM_THREADS", "0") or os.environ.get("OMP_NUM_THREADS", "0"))
    torch.set_num_threads(n or os.cpu_count() or 1)
