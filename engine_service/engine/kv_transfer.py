"""KV blocks between engines: a prompt's cached full blocks out as bytes, and into another engine's prefix cache.

The hand-over of prefill/decode disaggregation goes through the prefix cache. The prefill engine computes the
prompt; `export_prompt_blocks` copies the K/V (and int8 scales) of the prompt's leading full blocks that its cache
holds, with their chain hashes. The decode engine's `import_prompt_blocks` writes them into free blocks of its own
pool and registers them in its prefix cache under the same hashes (checked against the hashes it computes itself
from the prompt's token ids: a transfer for other tokens is refused, block by block). When the request is then
added there, `match_prefix` attaches them like any cached prefix, and only the tail the blocks do not cover (at
least one token, whose logits start the decoding) is computed again. Nothing of the request's own state travels:
beam search, seeded sampling, speculative decoding and grammars start on the decode engine as they would anywhere,
so its output is the colocated output.

Blocks are plain bytes in one fixed layout (per block: K then V of every layer, then the int8 scales), so any
transport can carry them (server/kv_connector.py: Redis); both engines must run the same model, block size and KV
dtype (checked).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_service.engine.block_manager import chain_hash


@dataclass
class KVBlocks:
    """The K/V of a prompt's leading full blocks, as bytes."""

    block_size: int
    kv_dtype: str  # "float32", "bfloat16", "int8", ...
    block_shape: list[int]  # one block's K/V: [layers, 2, block_size, kv_heads, head_dim]
    hashes: list[bytes]  # the chain hash of each block, in order
    data: list[bytes]  # per block: K/V (block_shape, kv_dtype) then, for int8, the scales ([layers, 2, kv_heads] fp32)

    @property
    def num_bytes(self) -> int:
        return sum(len(d) for d in self.data)

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size


def _layout(engine) -> tuple[str, list[int]]:
    kv = engine.runner.kv_cache
    return str(kv.dtype).removeprefix("torch."), [kv.shape[0], 2, *kv.shape[3:]]


def export_prompt_blocks(engine, token_ids: list[int]) -> KVBlocks:
    """The leading full blocks of `token_ids` that `engine`'s prefix cache holds (e.g. just after its prefill)."""
    bm, runner = engine.block_manager, engine.runner
    dtype, shape = _layout(engine)
    out = KVBlocks(bm.block_size, dtype, shape, [], [])
    parent = None
    for start in range(0, len(token_ids) - bm.block_size + 1, bm.block_size):
        tokens = tuple(token_ids[start:start + bm.block_size])
        h = chain_hash(parent, tokens)
        block_id = bm.cached.get(h)
        if block_id is None or bm.blocks[block_id].token_ids != tokens:
            break
        data = _to_bytes(runner.kv_cache[:, :, block_id])
        if runner.kv_scales is not None:
            data += _to_bytes(runner.kv_scales[:, :, block_id])
        out.hashes.append(h)
        out.data.append(data)
        parent = h
    return out


def import_prompt_blocks(engine, token_ids: list[int], blocks: KVBlocks) -> int:
    """Write `blocks` into `engine`'s pool as cached prefix blocks of `token_ids`; returns the tokens now cached.

    Stops at the first block whose hash is not the one `token_ids` give, or when no block is free to take (what is
    not imported is computed again). Blocks the cache already holds are kept as they are."""
    bm, runner = engine.block_manager, engine.runner
    dtype, shape = _layout(engine)
    if (blocks.block_size, blocks.kv_dtype, blocks.block_shape) != (bm.block_size, dtype, shape):
        raise ValueError(f"kv transfer: blocks of size {blocks.block_size}, {blocks.kv_dtype} {blocks.block_shape} "
                         f"do not fit this engine's ({bm.block_size}, {dtype} {shape})")
    kv_bytes = runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
    parent, imported = None, 0
    for i, (h, data) in enumerate(zip(blocks.hashes, blocks.data)):
        tokens = tuple(token_ids[i * bm.block_size:(i + 1) * bm.block_size])
        if len(tokens) < bm.block_size or chain_hash(parent, tokens) != h:
            break
        block_id = bm.adopt(h, parent, tokens)
        if block_id is None:
            break
        if block_id >= 0:  # a newly taken block: fill it (-1: the cache already had it)
            runner.kv_cache[:, :, block_id].copy_(_from_bytes(data[:kv_bytes], runner.kv_cache.dtype, shape))
            if runner.kv_scales is not None:
                scales = runner.kv_scales[:, :, block_id]
                scales.copy_(_from_bytes(data[kv_bytes:], torch.float32, list(scales.shape)))
        parent, imported = h, imported + bm.block_size
    return imported


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
