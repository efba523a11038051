"""A replica's settings: where Redis is, how it names itself, how much it pulls, how long results live."""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from shared.keys import Keys
from shared.limits import Limits


def default_replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


@dataclass
class ReplicaConfig:
    redis_url: str
    keys: Keys = field(default_factory=Keys.from_env)
    name: str = field(default_factory=default_replica_name)
    model_name: str = ""
    claim_idle_s: float = 10.0  # a pending entry idle this long (its replica is gone) is claimed by another
    result_ttl_s: int = 3600
    read_block_ms: int = 100
    expected_tokens: int = 256  # per-request KV estimate (prompt + output) when deciding how much to pull
    max_pull: int = 16  # most entries taken in one read
    stats_interval_s: float = 0.25  # engine.stats() refresh (capacity, /metrics); it walks every KV block
    kv_snapshot_ttl_s: float = 6.0  # the KV snapshot key (playground block map) outlives a stalled replica this long
    steps_ttl_s: float = 600.0  # the step-record stream (playground roofline) outlives its last step this long
    # step records go out at most this often while requests run (and at once before a result or when the engine
    # idles): per step they cost a token ~0.1 ms of the publisher's and Valkey's CPU on the engine's cores
    steps_interval_s: float = 0.05
    # a request picked up this many times (each earlier replica died running it) goes to the dead-letter stream
    max_attempts: int = field(default_factory=lambda: int(os.environ.get("DECODELAB_MAX_ATTEMPTS", 3)))
    # a group consumer with nothing pending, no heartbeat and idle this long is removed (a replica that is gone)
    consumer_gc_idle_s: float = 300.0
    # an entry routed to a live replica that has waited this long in its queue may be taken by an idle replica
    steal_after_s: float = field(default_factory=lambda: float(os.environ.get("DECODELAB_STEAL_AFTER_S", 2.0)))
    limits: Limits = field(default_factory=Limits.from_env)
    # both: prefill and decode here; prefill: compute prompts and hand their KV blocks to a decode replica; decode:
    # take handed-over requests (docs/redis-protocol.md, "Prefill/decode disaggregation")
    role: str = "both"
    kv_transfer_ttl_s: float = field(default_factory=lambda: float(os.environ.get("DECODELAB_KV_TRANSFER_TTL_S", 30)))

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role: must be both, prefill or decode, got {self.role!r}")

    @property
    def own_stream(self) -> str:  # requests routed to this replica (shared/router.py)
        return self.keys.replica_stream(self.name)

    @property
    def heartbeat_s(self) -> float:
        return min(1.0, self.claim_idle_s / 4)

    @property
    def kv_blocks_ttl_ms(self) -> int:  # the published prefix-cache set outlives its replica's last heartbeat this long
        return int(self.heartbeat_s * 3000)
