"""A compact picture of the engine's KV cache for the playground's block map (built on the engine thread)."""
from __future__ import annotations

import time

from engine_service.engine.stats import EngineStats
from engine_service.engine.utils import cdiv
from shared.monitor import KV_MAP_LIMIT, KVSeq, KVSnapshot


def kv_snapshot(engine, replica: str, model: str, stats: EngineStats | None = None) -> KVSnapshot:
    """Every sequence's block table, the prefix-cached block ids and engine.stats(); touches the engine."""
    sched, bm = engine.scheduler, engine.block_manager
    seqs = []
    for status, group in (("running", sched.running), ("waiting", sched.waiting)):
        for s in group:
            seqs.append(KVSeq(request_id=s.request.request_id, index=s.index, status=status, tokens=s.num_tokens,
                              computed=s.num_computed_tokens, cached_prompt_tokens=s.request.num_cached_tokens,
                              blocks=list(s.block_table)))
    cached = [b for b in bm.cached.values()]
    highest = max([b for s in seqs for b in s.blocks] + cached + [-1])
    map_size = min(bm.num_blocks, KV_MAP_LIMIT, max(64, cdiv(highest + 1, 32) * 32))
    stats = stats if stats is not None else engine.stats()
    return KVSnapshot(replica=replica, model=model, at=time.time(), block_size=engine.config.block_size,
                      stats=stats.to_dict(), map_size=map_size,
                      cached=sorted(b for b in cached if b < map_size), seqs=seqs)
