"""CUDA graphs for decode-only steps.

A decode step of a small model is hundreds of short kernels; launched one by one from Python they cost
more than they run. So the model forward is captured once per batch size in `capture_sizes()` over
static input buffers, and a decode batch is copied in, padded up to the next captured size, and replayed.
Padding rows store their K/V to slot -1 (store_kvcache skips it) and attend to one position (context_len
1, a block table of zeros): they cost next to nothing and touch no block of a real sequence.

No host sync may happen inside the captured forward. The Triton decode wrapper sizes its split-K grid
from the block-table width, a Python int: the static table is always max_model_len wide, so the split
count is fixed per captured size. The torch decode path syncs (it sorts lengths on the host), so graphs
are used only with attention_backend="triton".
"""
import torch

from engine_service.engine.attention import AttentionMetadata
from engine_service.engine.utils import cdiv


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself: any decode batch pads by < 2x."""
    return [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs] + [max_num_seqs]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs, None when the batch is larger than all of them."""
    return next((s for s in sizes if s >= num_seqs), None)


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def fits(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Decode-only (one token per sequence), not larger than the largest graph, table not too wide."""
        return (meta.num_decode == num_tokens <= self.sizes[-1]
                and meta.decode_block_tables.shape[1] <= self.block_tables.shape[1])

    def static_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decode=size,
                                 decode_block_tables=self.block_tables[:size],
                                 decode_context_lens=self.context_lens[:size], prefill_cu_seqlens_q=None,
                                 prefill_context_lens=None, prefill_block_tables=None)
        return self.input_ids[:size], self.positions[:size], meta

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode batch into the static buffers and pad it; returns the padded size.
        Table columns past a row's blocks keep stale ids: the kernels never read past context_len."""
        n, width = input_ids.shape[0], meta.decode_block_tables.shape[1]
        size = padded_size(n, self.sizes)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.block_tables[n:size].zero_()
            self.context_lens[n:size].fill_(1)
        return size

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, all sharing one memory pool. The buffers hold padding (slot -1) while capturing,
        # so neither the warm-up nor the capture writes to the KV cache.
        pool = None
        for size in reversed(self.sizes):
            ids, pos, meta = self.static_inputs(size)
            self.hidden[:size] = self.model(ids, pos, meta)  # warm-up: Triton compiles, cuBLAS sets up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:size] = self.model(ids, pos, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's hidden states for the batch: a view of a static buffer, valid until the next run."""
        self.graphs[self.load(input_ids, positions, meta)].replay()
        return self.hidden[:input_ids.shape[0]]


def decode_graphs_for(runner) -> DecodeGraphs | None:
    """Captured graphs for the runner's model on CUDA with the Triton backend, unless enforce_eager."""
    config = runner.config
    # an int8 KV cache runs eager: the per-token store no longer syncs with the host, but capture with it is untested
    if (runner.device.type != "cuda" or config.enforce_eager or config.attention_backend != "triton"
            or config.kv_cache_dtype == "int8"):
        return None
    graphs = DecodeGraphs(runner.model, config.max_num_seqs, cdiv(runner.max_model_len, config.block_size),
                          runner.device)
    graphs.capture()
    return graphs
