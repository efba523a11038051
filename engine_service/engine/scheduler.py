"""Continuous batching under a token budget.

One rule covers prefill, chunked prefill, prefix hits and decode: each running sequence's
`num_computed_tokens` catches up to its `num_tokens`, as far as the step's token budget allows.
Running sequences go first (oldest first), then waiting ones join while blocks and seats last.
When blocks run out the newest running sequence is preempted by recompute. The live beams of a
beam request are one unit: admitted, scheduled and preempted together.
"""
from collections import deque
from dataclasses import dataclass, field

from engine_service.engine.block_manager import BlockManager
from engine_service.engine.config import EngineConfig
from engine_service.engine.sequence import Sequence, SequenceStatus


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

    @staticmethod
    def _split(unit: list[Sequence], budget: int) -> tuple[list[tuple[Sequence, int]], int]:
        todo = []
        for seq in unit:
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            todo.append((seq, n))
            budget -= n
        return todo, budget

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
            looked_up = []
            for seq in unit:
                if seq.num_computed_tokens == 0 and not seq.block_table:
                    cached = self.bm.match_prefix(seq)
                    looked_up.append((seq.num_tokens, cached))
                    if seq.request.first_scheduled_time is None:
                        seq.request.num_cached_tokens = cached
            todo, left = self._split(unit, budget)
            if self._blocks_needed(todo) > self.bm.num_free_blocks:
                for seq in unit:
                    self.bm.free(seq)  # give back the prefix hits; try again next step
                break
            for num_tokens, cached in looked_up:
                self.bm.record_prefix_lookup(num_tokens, cached)
            for seq in unit:
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            self._take(batch, todo)
            budget = left
        return batch

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
