"""Where each engine step sits on the machine's roofline: a FLOP / byte model of a step, and the measured roofs.

The cost model (`CostModel`) prices a step from its shape alone (no tensor work, a few integers per sequence):
per sequence, `start` tokens already in the KV cache and `new` tokens computed now (a `Chunk`), plus the number of
logits rows the runner computes (model_runner.execute: only the rows that sample, verify drafts or score prompt
positions, not every token of a prefill).

- FLOPs: 2 per decoder linear weight per token; attention 4 x head_dim x heads per (query, key) pair per layer
  (QK^T and PV; a query at position p sees p + 1 keys); the LM head 2 x hidden x vocab per logits row. A tied head
  multiplies like an untied one: it is the [vocab, hidden] embedding read as a weight. Int8 multiply-adds count
  as two operations, like float ones.
- Bytes: every weight read once per step, as stored (fp32 or oneDNN-packed fp32, int8 with its per-channel scales,
  fbgemm's fp16); the LM head only when some row needs logits; each sequence's KV context read once per layer
  and the new tokens' K/V written (an int8 cache: 1 byte per element plus its per-(token, head) fp32
  scale); each linear's input read and output written once in the model dtype; the embedding rows looked up; the
  fp32 logits written. Not counted: norms, RoPE, residual adds, softmax, the sampler, a draft model's own
  forwards, and the padding the torch decode path gathers (groups of 8 read up to the group's longest context).

Arithmetic intensity (FLOPs / bytes) is then a property of the batch: a prefill chunk of n tokens uses each weight
it reads n times, a decode step of b sequences b times. That is why prefill lands right of the ridge (compute-bound)
and decode left of it (memory-bound), and why batching more decoding sequences moves decode toward the ridge.

The roofs (`measure_roofs`, once per process, well under 1.5 s): compute = the best of a few 1024-square matmuls
in the model dtype (and, for int8 weights, of the engine's own int8 linear on a 256 x 2048 x 2048 product);
memory = bytes read per second summing a 256 MiB buffer, 8x the last-level cache of the 2-core target (32 MiB), so
it streams from DRAM. Both use the engine's thread count: one core's roofs are what a 1-thread engine can reach.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from engine_service.engine.models.int8_linear import HeadWeight, Int8Weight, RowSplitWeight, int8_kernel
from engine_service.engine.models.loader import head_dim
from engine_service.engine.models.packed_linear import Linear

STREAM_BYTES = 256 << 20  # the memory roof's buffer
MATMUL_N = 1024  # the compute roof's square matmul (2.1 GFLOP: ~30 ms on one Zen 3 core)
INT8_SHAPE = (256, 2048, 2048)  # rows, in, out of the int8 roof's product


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, hf_config) -> ModelShape:
        c = hf_config
        return cls(c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, head_dim(c),
                   c.intermediate_size, c.vocab_size)

    @property
    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of one decoder layer's matmuls: qkv, o, gate_up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(self.hidden, q + 2 * kv), (q, self.hidden), (self.hidden, 2 * self.intermediate),
                (self.intermediate, self.hidden)]

    @property
    def layer_params(self) -> int:
        return sum(i * o for i, o in self.linears)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's part of a step."""

    start: int  # its tokens already in the KV cache
    new: int  # tokens computed this step
    decode: int  # of `new`: its newest real token and the draft tokens verified with it; the rest is prefill


@dataclass
class StepShape:
    """What the cost model needs of a scheduled batch, taken before the step moves its sequences on."""

    chunks: list[Chunk]
    request_ids: list[str]  # each once, in batch order (a beam request runs several sequences)

    @classmethod
    def of(cls, batch) -> StepShape:
        chunks = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            # prompt positions, and generated ones recomputed after a preemption, are prefill
            first_decode = max(seq.num_prompt_tokens, seq.num_tokens - seq.num_draft_tokens - 1)
            chunks.append(Chunk(start, n, max(0, start + n - max(start, first_decode))))
        return cls(chunks, list(dict.fromkeys(s.request.request_id for s in batch.seqs)))


@dataclass(frozen=True)
class StepRecord:
    """One engine step, as the playground's roofline panel draws it."""

    step: int
    start: float  # unix time the step began
    seconds: float  # the whole LLMEngine.step call (scheduling and sampling included)
    prefill_tokens: int
    decode_tokens: int  # one per decoding sequence, plus the speculative draft tokens verified
    num_seqs: int
    request_ids: list[str]
    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True)
class CostModel:
    shape: ModelShape
    layer_weight_bytes: int  # every decoder linear of every layer, as stored
    head_weight_bytes: int
    act_bytes: int  # one activation element (the model dtype)
    kv_bytes: float  # one cached K or V element

    @classmethod
    def of(cls, runner) -> CostModel:
        """The model the runner loaded, weights as they are stored after packing or quantization."""
        model, shape = runner.model, ModelShape.of(runner.hf_config)
        layers = sum(_linear_bytes(m) for layer in model.layers for m in layer.modules() if isinstance(m, Linear))
        if model.quantized_head is not None:
            head = _stored_bytes(model.quantized_head, shape.vocab * shape.hidden)
        elif model.packed_head is not None:
            head = shape.vocab * shape.hidden * model.packed_head.element_size()
        else:
            head = _linear_bytes(model.lm_head) if model.lm_head is not None else model.embed_tokens.weight.nbytes
        kv_elem = runner.kv_dtype.itemsize
        if runner.kv_dtype == torch.int8:  # one fp32 scale per (token, KV head)
            kv_elem += 4 / shape.head_dim
        return cls(shape, layers, head, runner.dtype.itemsize, kv_elem)

    def flops(self, chunks: Iterable[Chunk], rows: int) -> int:
        s = self.shape
        tokens = pairs = 0
        for c in chunks:
            tokens += c.new
            pairs += c.new * c.start + c.new * (c.new + 1) // 2  # keys seen, summed over the chunk's queries
        attention = 4 * s.head_dim * s.heads * s.layers * pairs
        return 2 * s.layers * s.layer_params * tokens + attention + 2 * s.hidden * s.vocab * rows

    def bytes(self, chunks: Iterable[Chunk], rows: int) -> int:
        s = self.shape
        tokens = context = 0
        for c in chunks:
            tokens += c.new
            context += c.start + c.new
        kv_per_token = s.layers * 2 * s.kv_heads * s.head_dim * self.kv_bytes  # K and V, every layer
        activations = tokens * s.layers * sum(i + o for i, o in s.linears) * self.act_bytes
        embed = tokens * s.hidden * self.act_bytes
        head = (self.head_weight_bytes + rows * s.hidden * self.act_bytes + rows * s.vocab * 4) if rows else 0
        return int(self.layer_weight_bytes + head + kv_per_token * (context + tokens) + activations + embed)

    def record(self, step: int, start: float, seconds: float, shape: StepShape, rows: int) -> StepRecord:
        decode = sum(c.decode for c in shape.chunks)
        new = sum(c.new for c in shape.chunks)
        return StepRecord(step, start, seconds, new - decode, decode, len(shape.chunks), shape.request_ids,
                          self.flops(shape.chunks, rows), self.bytes(shape.chunks, rows))


def _stored_bytes(w: Int8Weight | HeadWeight | RowSplitWeight, numel: int) -> int:
    # a RowSplitWeight holds two int8 copies; a decode step reads one (the avx2 kernel's)
    if isinstance(w, HeadWeight):
        return numel * 2  # fbgemm's fp16 weight
    # codes plus their scales: one fp32 per output channel (fbgemm), or a step and offset per 32 weights (fp32, or
    # fp16 where that is exact: cpu_int8.Matrix.half); a weight on a 4-bit grid is held as 4-bit codes (`nibbles`)
    matrix = getattr(w, "matrix", None)
    if matrix is None:
        return numel + w.scale.nbytes + w.group_bytes
    return (numel // 2 if matrix.nibbles else numel) + matrix.steps.nbytes + matrix.offsets.nbytes


def _linear_bytes(m: Linear) -> int:
    """A packed_linear.Linear as it runs: int8 / fp16, oneDNN-packed, or its dense weight (plus any bias)."""
    numel = m.in_features * m.out_features
    bias = m.bias.nbytes if m.bias is not None else 0
    if m.int8 is not None:
        return _stored_bytes(m.int8, numel) + bias
    if m.packed is not None:
        return numel * m.packed.element_size() + bias
    return numel * m.weight.element_size() + bias


# ---- the roofs
@dataclass(frozen=True)
class Roofs:
    kind: str  # the compute roof's kind: the model dtype ("float32", ...), or "int8" for int8 weights
    flops_per_s: float  # compute roof: that kind's matmul peak
    bytes_per_s: float  # memory roof
    matmul_flops_per_s: float  # the model dtype's matmul peak (the compute roof unless kind is "int8")
    threads: int
    seconds: float  # what measuring took

    @property
    def ridge(self) -> float:
        """The arithmetic intensity (FLOP / byte) where the two roofs meet."""
        return self.flops_per_s / self.bytes_per_s

    def to_dict(self) -> dict:
        return asdict(self)


def _best_seconds(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: first-touch pages, kernel selection
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _matmul_roof(device: str, dtype: torch.dtype, sync) -> float:
    n = MATMUL_N if device == "cpu" else 8 * MATMUL_N  # a GPU needs more work to reach its peak
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _best_seconds(lambda: torch.mm(a, b, out=out), 4, sync)


def _int8_roof(device: str, dtype: torch.dtype, kernel: str, sync) -> float:
    rows, k, m = INT8_SHAPE
    w = Int8Weight(torch.randn(m, k, device=device), None, kernel)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    return 2 * rows * k * m / _best_seconds(lambda: w(x), 4, sync)


def _memory_roof(device: str, sync) -> float:
    # 4x on a GPU: its L2 is up to 50 MiB and it streams 256 MiB in well under a millisecond
    buf = torch.ones(STREAM_BYTES // 4 * (1 if device == "cpu" else 4), device=device)
    return buf.nbytes / _best_seconds(lambda: buf.sum(), 3, sync)  # bytes read; the sum writes one number


@functools.cache
def measure_roofs(num_threads: int | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  int8_kernel: str | None = None) -> Roofs:
    """The compute and memory roofs of this machine for an engine with these settings (cached per process).
    `int8_kernel` (int8_linear.int8_kernel): also time the engine's int8 linear and make it the compute roof."""
    began = time.perf_counter()
    before = torch.get_num_threads()
    threads = num_threads or before
    torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    try:
        with torch.inference_mode():
            matmul = _matmul_roof(device, dtype, sync)
            compute, kind = matmul, str(dtype).removeprefix("torch.")
            if int8_kernel is not None:
                compute, kind = _int8_roof(device, dtype, int8_kernel, sync), "int8"
            memory = _memory_roof(device, sync)
    finally:
        torch.set_num_threads(before)
    return Roofs(kind, compute, memory, matmul, threads, time.perf_counter() - began)


def engine_roofs(engine) -> Roofs:
    """measure_roofs with the engine's device, dtype, threads and int8 kernel."""
    c, runner = engine.config, engine.runner
    kernel = int8_kernel(runner.device) if c.quantization == "int8" else None
    return measure_roofs(c.num_threads or torch.get_num_threads(), str(runner.device), runner.dtype, kernel)
