"""What the threads of one replica share: the engine, Redis, the jobs it holds, and the two queues between them.

Ownership: only the engine thread calls the engine; only the publisher writes events and results; the intake
thread adds jobs, the engine thread ends them; the control thread reads them (cancels, heartbeats).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import redis

from engine_service.engine.kv_transfer import KVBlocks
from engine_service.engine.stats import EngineStats
from engine_service.engine.utils import cdiv
from engine_service.server.config import ReplicaConfig
from engine_service.server.jobs import Command, Finish, HandOver, Job, OutboxItem
from engine_service.server.metrics import ReplicaMetrics
from shared.protocol import DoneEvent, ErrorEvent, encode

CONN_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


@dataclass(eq=False)
class ReplicaState:
    engine: object  # LLMEngine
    cfg: ReplicaConfig
    metrics: ReplicaMetrics
    redis: redis.Redis
    stats: EngineStats  # the engine's latest stats(), refreshed by the engine thread
    jobs: dict[str, Job] = field(default_factory=dict)  # running on this replica (pulled, not yet finished)
    commands: queue.Queue[Command | None] = field(default_factory=queue.Queue)  # -> engine thread
    outbox: queue.Queue[OutboxItem] = field(default_factory=queue.Queue)  # -> publisher thread
    stop: threading.Event = field(default_factory=threading.Event)
    pulling: threading.Event = field(default_factory=threading.Event)
    # set once the control thread's SUBSCRIBE to the cancel channel is confirmed (Replica.start waits for it)
    listening: threading.Event = field(default_factory=threading.Event)
    max_batch: int = 0
    redis_ok: bool = False
    queue_length: int = 0  # entries in the stream not yet delivered to any replica
    engine_error: str | None = None
    roofs: dict | None = None  # the machine's measured roofs (engine/roofline.py Roofs.to_dict), for the heartbeat
    # set when the published prefix-cache set must be rewritten whole (at start; after Redis lost it): the engine
    # thread then queues a KVSync
    kv_resync: threading.Event = field(default_factory=threading.Event)
    kv_connector: object | None = None  # server/kv_connector.py KVConnector: prefill/decode hand-overs

    @property
    def keys(self):
        return self.cfg.keys

    def capacity(self) -> int:
        """How many more requests this replica should pull now."""
        free_seqs = self.engine.config.max_num_seqs - len(self.jobs)
        st = self.stats
        if st.num_waiting > 0 and self.jobs:
            return 0  # the engine already has a backlog it cannot schedule
        unstarted = sum(1 for j in list(self.jobs.values()) if not j.started)
        by_blocks = st.blocks_free // cdiv(self.cfg.expected_tokens, st.block_size) - unstarted
        cap = min(free_seqs, by_blocks, self.cfg.max_pull)
        return max(cap, 1) if not self.jobs else max(cap, 0)

    def hand_over(self, job: Job, blocks: KVBlocks) -> None:
        """A prefilled job leaves this replica for a decode replica (the publisher moves its entry)."""
        self.jobs.pop(job.rid, None)
        self.metrics.finished.labels("handed_over").inc()
        self.outbox.put(HandOver(job, blocks))

    def end(self, job: Job, terminal: DoneEvent | ErrorEvent) -> None:
        """The job's last word: forget it here, hand the terminal event to the publisher's atomic finish."""
        self.jobs.pop(job.rid, None)
        outcome = terminal.finish_reason if isinstance(terminal, DoneEvent) else terminal.code
        self.metrics.finished.labels(outcome or "unknown").inc()
        self.outbox.put(Finish(job.rid, job.entry_id, job.stream, encode(terminal), job.request.client_id))
