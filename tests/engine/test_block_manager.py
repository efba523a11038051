"""Block manager: prefix hits, collision safety, fork, copy-on-write, eviction order, rollback, and a
stateful random test of every operation against a shadow KV cache."""
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from engine_service.engine import block_manager as bm_module
from engine_service.engine.block_manager import BlockManager, chain_hash


@dataclass(eq=False)
class FakeSeq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)


def compute(bm: BlockManager, seq: FakeSeq, n: int | None = None) -> list[tuple[int, int]]:
    """One scheduler step for `seq`: allocate, (the model writes), advance, register the full blocks."""
    n = len(seq.token_ids) - seq.num_computed_tokens if n is None else n
    copies = bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return copies


def admit(bm: BlockManager, tokens: list[int]) -> FakeSeq:
    seq = FakeSeq(list(tokens))
    bm.match_prefix(seq)
    compute(bm, seq)
    return seq


def refs(bm: BlockManager, table: list[int]) -> list[int]:
    return [bm.blocks[b].ref_count for b in table]


def test_prefix_hit_across_requests_shares_the_leading_full_blocks():
    bm = BlockManager(16, 4)
    a = admit(bm, list(range(10, 20)))
    b = FakeSeq(list(range(10, 18)) + [99, 98, 97])
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert b.block_hashes == a.block_hashes[:2]
    assert refs(bm, a.block_table) == [2, 2, 1]


def test_cached_blocks_outlive_the_request_that_computed_them():
    bm = BlockManager(16, 4)
    a = admit(bm, list(range(12)))
    table = list(a.block_table)
    bm.free(a)
    b = FakeSeq(list(range(12)) + [40])
    assert bm.match_prefix(b) == 12
    assert b.block_table == table


def test_digest_collision_with_other_tokens_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: b"same digest for all")
    bm = BlockManager(16, 4)
    admit(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.match_prefix(FakeSeq([9, 10, 11, 12, 13])) == 0
    assert bm.match_prefix(FakeSeq([1, 2, 3, 4, 9, 9, 9, 9, 0])) == 4  # the first block is a real hit


def test_same_tokens_after_another_prefix_is_not_a_hit(monkeypatch):
    # a digest that ignores the parent: block [5..8] after [1..4] collides with [5..8] after [9..12]
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: bytes(tokens))
    bm = BlockManager(16, 4)
    admit(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    admit(bm, [9, 10, 11, 12, 13, 14, 15, 16])
    # the first block hits; the second would reuse K/V computed after [1, 2, 3, 4]
    assert bm.match_prefix(FakeSeq([9, 10, 11, 12, 5, 6, 7, 8, 0])) == 4


def test_fork_shares_every_block_without_taking_new_ones():
    bm = BlockManager(16, 4)
    parent = admit(bm, list(range(10)))
    free = bm.num_free_blocks
    child = FakeSeq(list(parent.token_ids))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert child.block_hashes == parent.block_hashes
    assert child.num_computed_tokens == parent.num_computed_tokens == 10
    assert refs(bm, parent.block_table) == [2, 2, 2]
    assert bm.num_free_blocks == free


def test_append_into_a_shared_last_block_copies_it_and_keeps_the_other_holders_block():
    bm = BlockManager(16, 4)
    parent = admit(bm, list(range(10)))  # 4 + 4 + 2: the last block is partial
    child = FakeSeq(list(parent.token_ids))
    bm.fork(parent, child)
    shared, last = parent.block_table[:2], parent.block_table[2]
    child.token_ids.append(77)
    copies = compute(bm, child, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == last and dst not in parent.block_table
    assert parent.block_table == shared + [last]
    assert child.block_table == shared + [dst]
    assert refs(bm, shared) == [2, 2] and refs(bm, [last, dst]) == [1, 1]
    assert bm.stats.cow_copies == 1
    parent.token_ids.append(88)
    assert compute(bm, parent, 1) == []  # no longer shared: written in place
    assert parent.block_table[2] == last


def test_append_at_a_block_boundary_after_fork_needs_no_copy():
    bm = BlockManager(16, 4)
    parent = admit(bm, list(range(8)))
    child = FakeSeq(list(parent.token_ids))
    bm.fork(parent, child)
    child.token_ids.append(1)
    assert compute(bm, child, 1) == []
    assert child.block_table[:2] == parent.block_table and len(child.block_table) == 3


def test_can_allocate_counts_the_copy_on_write_block():
    bm = BlockManager(3, 4)
    parent = admit(bm, list(range(10)))  # takes all 3 blocks
    child = FakeSeq(list(parent.token_ids))
    bm.fork(parent, child)
    assert bm.blocks_needed(child, 1) == 1
    assert not bm.can_allocate(child, 1)


def test_free_returns_every_block_once_the_last_holder_is_gone():
    bm = BlockManager(8, 4)
    a = admit(bm, list(range(10)))
    child = FakeSeq(list(a.token_ids))
    bm.fork(a, child)
    b = admit(bm, list(range(50, 55)))
    bm.free(a)
    assert bm.num_free_blocks == 8 - 3 - 2  # the child still holds a's blocks
    assert refs(bm, child.block_table) == [1, 1, 1]
    bm.free(child)
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert a.block_table == [] and a.num_computed_tokens == 0


def test_eviction_takes_the_tail_of_a_freed_request_first():
    bm = BlockManager(4, 2)
    a = admit(bm, [1, 2, 3, 4, 5, 6])  # three full cached blocks, one blank block left
    head, tail = a.block_table[:2], a.block_table[2]
    bm.free(a)
    b = admit(bm, [50, 51, 52, 53])  # the blank block, then one eviction
    assert tail in b.block_table and not set(head) & set(b.block_table)
    assert bm.stats.evictions == 1
    assert bm.match_prefix(FakeSeq([1, 2, 3, 4, 5, 6, 7])) == 4  # the head is still cached


def test_blank_blocks_are_reused_before_cached_ones_are_evicted():
    bm = BlockManager(4, 2)
    bm.free(admit(bm, [1, 2, 3, 4]))  # two cached blocks
    bm.free(admit(bm, [9]))  # a partial block: nothing to cache, freed after the cached ones
    admit(bm, [7, 7, 7])  # two blocks; two blank ones are free
    assert bm.stats.evictions == 0
    assert bm.match_prefix(FakeSeq([1, 2, 3, 4, 5])) == 4


def test_truncate_rolls_back_frees_spare_blocks_and_the_rewritten_block_leaves_the_cache():
    bm = BlockManager(8, 4)
    seq = admit(bm, list(range(10)))
    second, third = seq.block_table[1], seq.block_table[2]
    bm.truncate(seq, 5)
    assert seq.num_computed_tokens == 5
    assert seq.block_table[1] == second and len(seq.block_table) == 2
    assert len(seq.block_hashes) == 1
    assert bm.blocks[third].ref_count == 0 and third in bm.free_queue
    seq.token_ids[5:] = [40, 41, 42]
    compute(bm, seq)  # rewrites slots 5.. of the second block
    assert bm.match_prefix(FakeSeq(list(range(10)))) == 4  # the old second block is gone
    assert bm.match_prefix(FakeSeq([0, 1, 2, 3, 4, 40, 41, 42, 0])) == 8


def test_truncate_into_a_shared_block_copies_it_on_the_next_write():
    bm = BlockManager(8, 4)
    parent = admit(bm, list(range(8)))
    child = FakeSeq(list(parent.token_ids))
    bm.fork(parent, child)
    second = parent.block_table[1]
    bm.truncate(child, 6)
    assert bm.blocks[second].hash is not None  # the parent's copy stays cached
    child.token_ids[6:] = [30, 31]
    assert compute(bm, child, 2) == [(second, child.block_table[1])]
    assert bm.match_prefix(FakeSeq(list(range(8)) + [0])) == 8


def test_rolled_back_block_left_alone_in_a_table_leaves_the_cache_before_it_is_rewritten():
    # found by the state machine: truncated while shared (so it stayed cached), then the other holder left
    bm = BlockManager(8, 4)
    parent = admit(bm, list(range(8)))
    child = FakeSeq(list(parent.token_ids))
    bm.fork(parent, child)
    bm.truncate(child, 6)
    bm.free(parent)
    child.token_ids[6:] = [30, 31]
    assert compute(bm, child, 2) == []  # no longer shared: written in place...
    assert bm.match_prefix(FakeSeq(list(range(8)) + [0])) == 4  # ...so the old tokens no longer hit it
    assert bm.match_prefix(FakeSeq([0, 1, 2, 3, 4, 5, 30, 31, 0])) == 8


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = BlockManager(8, 4)
    a = admit(bm, list(range(8)))
    b = FakeSeq(list(range(8)))
    assert bm.match_prefix(b) == 4
    assert b.block_table == a.block_table[:1]
    assert compute(bm, b) == []
    assert b.block_table[1] != a.block_table[1]


def test_no_hits_with_prefix_caching_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    admit(bm, list(range(8)))
    assert bm.match_prefix(FakeSeq(list(range(9)))) == 0
    assert not bm.cached


# ---- stateful: random interleavings against a shadow KV cache

def chain(tokens: list[int], bs: int) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // bs):
        hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(tokens[i * bs:(i + 1) * bs])))
    return hashes


TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=8)  # a tiny alphabet: prefixes collide often
MAX_SEQS = 4


class BlockManagerMachine(RuleBasedStateMachine):
    """The shadow cache holds, per slot, the whole prefix whose K/V a real model would have stored
    there; every sequence must see exactly its own prefixes through its block table."""

    @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from([2, 3, 4, 1]),
                caching=st.sampled_from([True, True, True, True, False]))
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.bm.record_events()
        self.published: set[bytes] = set()  # what a router knows from the KV events so far
        self.bs = block_size
        self.seqs: list[FakeSeq] = []
        self.kv: list[list[tuple | None]] = [[None] * block_size for _ in range(num_blocks)]

    # -- the model side: copy, then write the new tokens' K/V
    def _compute(self, seq: FakeSeq, n: int) -> bool:
        bm = self.bm
        if not bm.can_allocate(seq, n):
            event("allocation refused")
            return False
        held_by_others = {b for s in self.seqs if s is not seq for b in s.block_table}
        target = seq.num_computed_tokens // self.bs
        if target < len(seq.block_table) and bm.blocks[seq.block_table[target]].hash is not None:
            event("write into a rolled-back cached block")
        old_table, free_before, need = list(seq.block_table), bm.num_free_blocks, bm.blocks_needed(seq, n)
        evictions = bm.stats.evictions
        copies = bm.allocate(seq, n)
        assert free_before - bm.num_free_blocks == need
        new_blocks = set(seq.block_table) - set(old_table)
        assert not new_blocks & held_by_others, "handed out a block someone holds"
        for src, dst in copies:
            event("copy-on-write")
            assert src in old_table and dst in new_blocks and src in held_by_others
            self.kv[dst] = list(self.kv[src])
        if bm.stats.evictions > evictions:
            event("evicted a cached block")
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = bm.blocks[seq.block_table[p // self.bs]]
            assert block.ref_count == 1 and block.hash is None, "write into a shared or cached block"
            self.kv[block.block_id][p % self.bs] = tuple(seq.token_ids[:p + 1])
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)
        return True

    def _admit(self, seq: FakeSeq, chunk: int) -> None:
        hit = self.bm.match_prefix(seq)
        assert hit % self.bs == 0 and hit < len(seq.token_ids)
        if hit:
            event("prefix hit")
        self._check_view(seq)
        n = min(len(seq.token_ids) - hit, chunk)
        if self._compute(seq, n):
            self.seqs.append(seq)
        else:
            self.bm.free(seq)  # the scheduler gives the hits back and retries later

    def _pick(self, i: int) -> FakeSeq | None:
        return self.seqs[i % len(self.seqs)] if self.seqs else None

    # -- operations
    @rule(tokens=TOKENS, chunk=st.integers(1, 12), i=st.integers(0, 20))
    def add(self, tokens, chunk, i):
        if len(self.seqs) >= MAX_SEQS:  # few sequences, so that the operations keep meeting
            self.free(i)
        self._admit(FakeSeq(list(tokens)), chunk)

    @rule(i=st.integers(0, 20), chunk=st.integers(1, 12), token=st.integers(0, 2))
    def step(self, i, chunk, token):
        seq = self._pick(i)
        if seq is None:
            return
        if seq.num_computed_tokens == len(seq.token_ids):  # decode: the sampled token joins
            seq.token_ids.append(token)
        self._compute(seq, min(len(seq.token_ids) - seq.num_computed_tokens, chunk))

    def _fork(self, i: int) -> FakeSeq | None:
        parent = self._pick(i)
        if parent is None or len(self.seqs) >= MAX_SEQS:
            return None
        child = FakeSeq(list(parent.token_ids))
        free = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        assert self.bm.num_free_blocks == free
        self.seqs.append(child)
        return child

    @rule(i=st.integers(0, 20))
    def fork(self, i):
        self._fork(i)

    @rule(i=st.integers(0, 20), keep=st.integers(0, 20), new_tokens=TOKENS)
    def fork_and_diverge(self, i, keep, new_tokens):
        """A branch that rolls back part of what it shares (a beam or a speculative sample)."""
        if self._fork(i) is not None:
            self.truncate(len(self.seqs) - 1, keep, new_tokens)

    @rule(i=st.integers(0, 20))
    def free(self, i):
        seq = self._pick(i)
        if seq is None:
            return
        self.bm.free(seq)
        self.seqs.remove(seq)

    @rule(i=st.integers(0, 20), chunk=st.integers(1, 12))
    def preempt_and_readmit(self, i, chunk):
        seq = self._pick(i)
        if seq is None:
            return
        self.bm.free(seq)
        self.seqs.remove(seq)
        self._admit(FakeSeq(seq.token_ids), chunk)

    @rule(i=st.integers(0, 20), keep=st.integers(0, 20), new_tokens=TOKENS)
    def truncate(self, i, keep, new_tokens):
        seq = self._pick(i)
        if seq is None:
            return
        keep %= seq.num_computed_tokens + 1
        self.bm.truncate(seq, keep)
        seq.token_ids[keep:] = new_tokens  # the rejected tokens are replaced
        assert len(seq.block_table) == -(-keep // self.bs)

    # -- invariants
    def _check_view(self, seq: FakeSeq) -> None:
        bs = self.bs
        assert len(seq.block_table) == -(-seq.num_computed_tokens // bs)
        for p in range(seq.num_computed_tokens):
            assert self.kv[seq.block_table[p // bs]][p % bs] == tuple(seq.token_ids[:p + 1]), \
                f"position {p} reads another sequence's K/V"
        if self.bm.enable_prefix_caching:
            assert seq.block_hashes == chain(seq.token_ids[:seq.num_computed_tokens], bs)

    @invariant()
    def every_sequence_sees_its_own_tokens(self):
        for seq in self.seqs:
            self._check_view(seq)

    @invariant()
    def ref_counts_equal_holders_and_nothing_leaks(self):
        bm = self.bm
        holders = Counter(b for s in self.seqs for b in s.block_table)
        assert all(len(set(s.block_table)) == len(s.block_table) for s in self.seqs)
        assert [b.ref_count for b in bm.blocks] == [holders[b.block_id] for b in bm.blocks]
        assert set(bm.free_queue) == {b.block_id for b in bm.blocks if b.ref_count == 0}
        summary = bm.summary()
        assert summary["blocks_free"] + summary["blocks_used"] == summary["blocks_total"] == len(bm.blocks)
        assert summary["blocks_used"] == sum(1 for c in holders.values() if c > 0)
        assert summary["blocks_shared"] == sum(1 for c in holders.values() if c > 1)

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self):
        bm, bs = self.bm, self.bs
        for h, block_id in bm.cached.items():
            block = bm.blocks[block_id]
            assert block.hash == h
            content = self.kv[block_id]
            prefix = content[-1]  # the whole prefix up to the block's last token
            assert prefix is not None and len(prefix) % bs == 0
            assert content == [prefix[:len(prefix) - bs + j + 1] for j in range(bs)]
            assert block.token_ids == prefix[-bs:]
            assert chain(list(prefix), bs)[-1] == h
        for block in bm.blocks:
            assert block.hash is None or bm.cached.get(block.hash) == block.block_id


    @invariant()
    def kv_events_replay_to_the_cached_hashes(self):
        """A router that applies the events in order knows exactly which prefixes this cache holds."""
        for ev in self.bm.take_events():
            if ev.stored:
                assert ev.block_hash not in self.published, "stored twice without a removal between"
                self.published.add(ev.block_hash)
            else:
                assert ev.block_hash in self.published, "removed what was never stored"
                self.published.remove(ev.block_hash)
        assert self.published == set(self.bm.cached)


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(max_examples=600, stateful_step_count=40, deadline=None)


def fork_without_incref(self, parent, child):
    child.block_table, child.block_hashes = list(parent.block_table), list(parent.block_hashes)
    child.num_computed_tokens = parent.num_computed_tokens


def uncache_that_leaves_a_stale_entry(self, block):
    block.hash, block.token_ids, block.parent = None, (), None


def uncache_without_an_event(self, block):
    if self.cached.get(block.hash) == block.block_id:
        del self.cached[block.hash]
    block.hash, block.token_ids, block.parent = None, (), None


PLANTED_BUGS = {
    "eviction not reported as a KV event": ("_uncache", uncache_without_an_event),
    "no copy-on-write": ("_shared_write_index", lambda self, seq, n: None),
    "fork without ref counts": ("fork", fork_without_incref),
    "eviction leaves a stale cache entry": ("_uncache", uncache_that_leaves_a_stale_entry),
}


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_the_stateful_test_catches_planted_bugs(bug, monkeypatch):
    """The machine above is only worth its time if it fails on a broken block manager."""
    name, broken = PLANTED_BUGS[bug]
    monkeypatch.setattr(BlockManager, name, broken)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(BlockManagerMachine, settings=settings(
            max_examples=300, stateful_step_count=30, deadline=None, database=None, phases=[Phase.generate],
            derandomize=True))
