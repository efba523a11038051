"""EngineStats: one typed snapshot of the engine's counters (KV pool, prefix cache, scheduling, speculation).

Read by the replica (capacity, /metrics, the playground's KV panel via `to_dict`) and the benchmarks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    blocks_total: int
    blocks_used: int
    blocks_shared: int
    blocks_cached: int
    blocks_free: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, found
    cow_copies: int
    evictions: int
    block_size: int
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting for blocks or a seat
    num_requests: int
    preemptions: int
    steps: int
    spec_steps: int = 0  # verification forwards with at least one draft token
    spec_proposed: int = 0
    spec_accepted: int = 0
    draft_blocks_total: int | None = None  # the draft model's own pool, when the engine has one
    draft_blocks_used: int | None = None

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @classmethod
    def of(cls, engine) -> EngineStats:
        bm, sched, spec = engine.block_manager, engine.scheduler, engine.spec
        draft = spec.drafter.bm if spec.drafter is not None else None
        return cls(blocks_total=bm.num_blocks, blocks_used=bm.num_blocks - bm.num_free_blocks,
                   blocks_shared=bm.num_shared, blocks_cached=len(bm.cached), blocks_free=bm.num_free_blocks,
                   prefix_queries=bm.stats.prefix_queries, prefix_hits=bm.stats.prefix_hits,
                   cow_copies=bm.stats.cow_copies, evictions=bm.stats.evictions, block_size=engine.config.block_size,
                   num_running=len(sched.running), num_waiting=len(sched.waiting), num_requests=len(engine.requests),
                   preemptions=sched.num_preemptions, steps=engine.num_steps, spec_steps=spec.totals.steps,
                   spec_proposed=spec.totals.proposed, spec_accepted=spec.totals.accepted,
                   draft_blocks_total=draft.num_blocks if draft is not None else None,
                   draft_blocks_used=draft.num_blocks - draft.num_free_blocks if draft is not None else None)

    def to_dict(self) -> dict[str, float]:
        """The numbers, for the wire (the KV snapshot the playground reads)."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.spec_acceptance_rate is not None:
            out["spec_acceptance_rate"] = self.spec_acceptance_rate
        return out
