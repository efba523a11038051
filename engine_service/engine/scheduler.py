"""Continuous batching under a token budget.

One rule covers prefill, chunked prefill, prefix hits and decode: each running sequence's
`num_computed_tokens` catches up to its `num_tokens`, as far as the step's token budget allows.
Running sequences go first (oldest first), then waiting ones join while blocks and seats last.
When blocks run out the newest running sequence is preempted by recompute. The live beams of a
beam request are one unit: admitted, scheduled and preempted together. A preempted beam group
recomputes the way its first prefill went: its first beam computes the prefix all beams share, the
others fork it and compute only their own tails, so it never needs more blocks than admission
promised (LLMEngine.add_request). A step that schedules nothing while requests remain is a bug, and
fails loudly rather than spinning.
"""
from collections import deque
from dataclasses import dataclass, field

from engine_service.engine.block_manager import BlockManager
from engine_service.engine.config import EngineConfig
from engine_service.engine.sequence import Sequence, SequenceStatus
from engine_service.engine.utils import cdiv


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """A forked child runs right away, next to its parent."""
        seq.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)  # recompute later; its full blocks stay in the prefix cache meanwhile
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _running_units(self) -> list[list[Sequence]]:
        """The live beams of a beam request form one unit, scheduled and preempted together; any other
        sequence is a unit of its own. Units keep the running order (oldest first)."""
        units, groups = [], {}
        for seq in self.running:
            if seq.request.beam is None:
                units.append([seq])
            elif id(seq.request) in groups:
                groups[id(seq.request)].append(seq)
            else:
                groups[id(seq.request)] = [seq]
                units.append(groups[id(seq.request)])
        return units

    def _waiting_unit(self) -> list[Sequence]:
        head = self.waiting[0]
        if head.request.beam is None:
            return [head]
        unit = []
        for seq in self.waiting:  # a preempted beam group went back to the front as one block
            if seq.request is not head.request:
                break
            unit.append(seq)
        return unit

    def _blocks_needed(self, todo: list[tuple[Sequence, int]]) -> int:
        """Free blocks that allocating `todo` in order takes: several writers into one shared last block
        copy it only until the last holder is left (it then writes in place)."""
        need = sum(self.bm.blocks_needed(seq, n) for seq, n in todo)
        writers: dict[int, int] = {}
        for seq, n in todo:
            idx = seq.num_computed_tokens // self.bm.block_size
            if n > 0 and idx < len(seq.block_table):
                writers[seq.block_table[idx]] = writers.get(seq.block_table[idx], 0) + 1
        for block_id, m in writers.items():
            ref = self.bm.blocks[block_id].ref_count
            if ref > 1:
                need -= max(0, m - (ref - 1))
        return need

    def _take(self, batch: ScheduledBatch, todo: list[tuple[Sequence, int]]) -> None:
        for seq, n in todo:
            if n > 0:
                batch.copies += self.bm.allocate(seq, n)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)

    def _split(self, unit: list[Sequence], budget: int) -> tuple[list[tuple[Sequence, int]], int]:
        todo = []
        idle = self._join_first_beam(unit)
        for seq in unit:
            n = 0 if seq in idle else min(seq.num_tokens - seq.num_computed_tokens, budget)
            todo.append((seq, n))
            budget -= n
        return todo, budget

    def _shared_prefix(self, unit: list[Sequence]) -> int:
        """Tokens, in whole blocks, that every beam of the unit starts with (at least the prompt's full
        blocks), leaving each beam one token to compute."""
        first = unit[0].token_ids
        n = min(s.num_tokens for s in unit) - 1
        for seq in unit[1:]:
            n = next((i for i, (a, b) in enumerate(zip(first[:n], seq.token_ids)) if a != b), n)
        return n // self.bm.block_size * self.bm.block_size

    def _join_first_beam(self, unit: list[Sequence]) -> list[Sequence]:
        """Beams of a preempted group (no blocks) fork the first beam once it has computed their shared
        prefix; recomputing each beam whole could need W times the prompt's blocks. Returns the beams that
        still wait for it."""
        rest = [s for s in unit[1:] if not s.block_table]
        if not rest:
            return []
        shared = self._shared_prefix(unit)
        if shared == 0:
            return []
        if unit[0].num_computed_tokens < shared:
            return rest
        for seq in rest:
            self.bm.fork(unit[0], seq)
            self.bm.truncate(seq, shared)
        return []

    def _waiting_tails(self, todo: list[tuple[Sequence, int]]) -> int:
        """Blocks the beams waiting for the first one will take once they fork it: their own tails."""
        idle = [seq for seq, n in todo if n == 0 and not seq.block_table]
        if not idle:
            return 0
        shared = self._shared_prefix([seq for seq, _ in todo]) // self.bm.block_size
        return sum(cdiv(seq.num_tokens, self.bm.block_size) - shared for seq in idle)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        units = self._running_units()
        while units and budget > 0:
            unit = units[0]
            todo, left = self._split(unit, budget)
            # a beam whose siblings are still catching up (after a recompute) may have nothing to compute
            assert all(n > 0 or seq.request.beam is not None for seq, n in todo), \
                "a running sequence always has a token to compute"
            if self._blocks_needed(todo) > self.bm.num_free_blocks:
                victim = units.pop()
                for seq in reversed(victim):  # back to the front of the queue in order
                    self._preempt(seq)
                    batch.preempted.append(seq)
                if victim is unit:
                    break
                continue
            units.pop(0)
            self._take(batch, todo)
            budget = left
        if batch.preempted:  # no room to spare this step
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            unit = self._waiting_unit()
            first = unit[0]  # the other beams of a preempted group fork it (_join_first_beam)
            looked_up = None
            # a request scoring its prompt (prompt_logprobs.py) computes every position: no prefix hits for it
            if (first.num_computed_tokens == 0 and not first.block_table
                    and first.request.params.prompt_logprobs is None):
                looked_up = (first.num_tokens, self.bm.match_prefix(first))
                if first.request.first_scheduled_time is None:
                    first.request.num_cached_tokens = looked_up[1]
            todo, left = self._split(unit, budget)
            # the whole group's recompute must fit, or the group would be admitted only to be preempted
            if self._blocks_needed(todo) + self._waiting_tails(todo) > self.bm.num_free_blocks:
                for seq in unit:
                    self.bm.free(seq)  # give back the prefix hits; try again next step
                break
            if looked_up is not None:
                self.bm.record_prefix_lookup(*looked_up)
            for seq in unit:
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            self._take(batch, todo)
            budget = left
        assert batch.seqs or not self.has_unfinished(), (
            f"scheduler: a step scheduled nothing with {len(self.waiting)} waiting, {len(self.running)} running "
            f"and {self.bm.num_free_blocks} of {self.bm.num_blocks} blocks free: the waiting head can never run")
        return batch

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
