"""Continuous batching under a token budget.

One rule covers prefill, chunked prefill, prefix hits and decode: each running sequence's
`num_computed_tokens` catches up to its `num_tokens`, as far as the step's token budget allows.
Running sequences go first (oldest first), then waiting ones join while blocks and seats last.
When blocks run out the newest running sequence is preempted by recompute.
"""
from collections import deque
from dataclasses import dataclass, field

from engine_service.block_manager import BlockManager
from engine_service.config import EngineConfig
from engine_service.sequence import Sequence, SequenceStatus


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

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert n > 0, "a running sequence always has a token to compute"
            while not self.bm.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.copies += self.bm.allocate(seq, n)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break
        if batch.preempted:  # no room to spare this step
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_computed_tokens == 0 and not seq.block_table:
                cached = self.bm.match_prefix(seq)
                if seq.request.first_scheduled_time is None:
                    seq.request.num_cached_tokens = cached
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.can_allocate(seq, n):
                self.bm.free(seq)  # give back the prefix hits; try again next step
                break
            self.waiting.popleft()
            batch.copies += self.bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
