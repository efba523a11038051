"""Paged KV blocks: ref counts, hash-chained prefix cache, fork, copy-on-write, LRU eviction.

Pure bookkeeping over block ids; the KV tensors live in the model runner. A sequence is any object
with `token_ids`, `num_computed_tokens`, `block_table` and `block_hashes` (see sequence.py).

KV events: once `record_events()` is called, every hash entering the prefix cache and every hash leaving
it is recorded, in order, until `take_events()` hands them over. A replica publishes them so that routers
know which replica holds which prefix (docs/redis-protocol.md, "Prefix-aware routing"); the hash is the
chain below, which `shared/routing.py` computes the same way from token ids.
"""
import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from engine_service.engine.utils import cdiv


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and registered in the prefix cache
    # kept so that a hit must match the block's tokens and its parent's hash, not just the digest
    token_ids: tuple[int, ...] = ()
    parent: bytes | None = None


@dataclass
class BlockStats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    cow_copies: int = 0
    evictions: int = 0


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(frozen=True)
class KVEvent:
    stored: bool  # True: the hash entered the prefix cache; False: it left it (evicted or rewritten)
    block_hash: bytes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks in eviction order, front first: blank blocks, then cached ones (which keep
        # their hash) least recently freed first
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_shared = 0  # blocks with ref_count > 1, kept current so stats are O(1)
        self.stats = BlockStats()
        self.events: list[KVEvent] | None = None  # None: not recording (nobody would drain them)

    # ---- KV events
    def record_events(self) -> None:
        """Start recording KV events; `take_events` must then be called regularly (the list grows until it is)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events or [], ([] if self.events is not None else None)
        return events

    # ---- queries
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, seq, num_new_tokens: int) -> int:
        """Free blocks that `allocate(seq, num_new_tokens)` would take (new blocks + a COW copy)."""
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        need = max(0, total - len(seq.block_table))
        if self._shared_write_index(seq, num_new_tokens) is not None:
            need += 1
        return need

    def can_allocate(self, seq, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def summary(self) -> dict:
        return {
            "blocks_total": self.num_blocks,
            "blocks_used": self.num_blocks - self.num_free_blocks,
            "blocks_shared": self.num_shared,
            "blocks_cached": len(self.cached),
            "blocks_free": self.num_free_blocks,
            "prefix_queries": self.stats.prefix_queries,
            "prefix_hits": self.stats.prefix_hits,
            "cow_copies": self.stats.cow_copies,
            "evictions": self.stats.evictions,
        }

    # ---- allocation
    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:  # evict from the prefix cache
            self._uncache(block)
            self.stats.evictions += 1
        block.ref_count = 1
        return block_id

    def _incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1
        self.num_shared += block.ref_count == 2

    def _decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        self.num_shared -= block.ref_count == 2
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.hash is None:  # nothing worth keeping: reuse it before evicting a cached block
                self.free_queue.move_to_end(block_id, last=False)

    def _uncache(self, block: Block) -> None:
        if self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
            if self.events is not None:
                self.events.append(KVEvent(False, block.hash))
        block.hash, block.token_ids, block.parent = None, (), None

    def match_prefix(self, seq) -> int:
        """Attach the cached blocks of `seq`'s leading full blocks; returns the number of cached tokens.

        At least one token is always left to compute (its logits are needed), so a fully cached prompt
        gives back its last block and recomputes it.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        num_tokens = len(seq.token_ids)
        if not self.enable_prefix_caching:
            return 0
        bs, parent, hits = self.block_size, None, []
        for start in range(0, num_tokens - bs + 1, bs):
            tokens = tuple(seq.token_ids[start:start + bs])
            h = chain_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent != parent:  # a digest collision, not a hit
                break
            hits.append((block_id, h))
            parent = h
        if hits and len(hits) * bs == num_tokens:
            hits.pop()
        for block_id, h in hits:
            self._incref(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        seq.num_computed_tokens = len(hits) * bs
        return seq.num_computed_tokens

    def record_prefix_lookup(self, num_tokens: int, num_hits: int) -> None:
        """Counted once a looked-up sequence is admitted (a lookup retried next step counts once)."""
        self.stats.prefix_queries += num_tokens
        self.stats.prefix_hits += num_hits

    def _shared_write_index(self, seq, num_new_tokens: int) -> int | None:
        """Index in the block table of a shared block that the next write would touch."""
        if num_new_tokens <= 0:
            return None
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and self.blocks[seq.block_table[idx]].ref_count > 1:
            return idx
        return None

    def allocate(self, seq, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens` more tokens; returns copy-on-write (src, dst) block pairs."""
        assert self.can_allocate(seq, num_new_tokens)
        copies = []
        idx = self._shared_write_index(seq, num_new_tokens)
        if idx is not None:  # copy-on-write: the write would be seen by the other holders
            src = seq.block_table[idx]
            dst = self._take_free_block()
            self._decref(src)
            seq.block_table[idx] = dst
            copies.append((src, dst))
            self.stats.cow_copies += 1
        elif num_new_tokens > 0 and (idx := seq.num_computed_tokens // self.block_size) < len(seq.block_table):
            block = self.blocks[seq.block_table[idx]]
            if block.hash is not None:  # a cached block rolled back by truncate: it is about to change
                self._uncache(block)
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_free_block())
        return copies

    def cache_full_blocks(self, seq) -> None:
        """Register every computed full block of `seq` in the prefix cache (hash chained on its parent)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = seq.block_hashes[-1] if i else None
            h = chain_hash(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached and block.hash is None:
                block.hash, block.token_ids, block.parent = h, tokens, parent
                self.cached[h] = block.block_id
                if self.events is not None:
                    self.events.append(KVEvent(True, h))

    def adopt(self, h: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> int | None:
        """Register a block computed elsewhere (a KV transfer) as a cached prefix block, unheld; returns the block
        whose K/V the caller must now write, -1 when the cache already holds `h`, None when no block is free."""
        if not self.enable_prefix_caching:
            return None
        if (held := self.cached.get(h)) is not None and self.blocks[held].token_ids == token_ids:
            return -1
        if held is not None or not self.free_queue:
            return None  # a digest collision, or a full pool
        block_id = self._take_free_block()
        block = self.blocks[block_id]
        block.hash, block.token_ids, block.parent = h, token_ids, parent
        self.cached[h] = block_id
        if self.events is not None:
            self.events.append(KVEvent(True, h))
        self._decref(block_id)  # unheld, at the recent end of the eviction order, as a freed cached block
        return block_id

    def fork(self, parent, child) -> None:
        """`child` shares every block of `parent`; the first write into a shared block copies it."""
        assert not child.block_table
        for block_id in parent.block_table:
            self._incref(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def truncate(self, seq, num_tokens: int) -> None:
        """Roll back to `num_tokens` computed tokens (rejected speculative tokens), freeing spare blocks.

        A cached block cut in the middle keeps its hash (its K/V are intact) until the next write into
        it: `allocate` copies it if shared, else uncaches it first.
        """
        assert num_tokens <= seq.num_computed_tokens
        keep = cdiv(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            self._decref(seq.block_table.pop())
        del seq.block_hashes[num_tokens // self.block_size:]
        seq.num_computed_tokens = num_tokens

    def free(self, seq) -> None:
        # the tail goes to the free queue first, so it is evicted before the (more shareable) head
        for block_id in reversed(seq.block_table):
            self._decref(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
