"""Every Redis key and channel name, under one configurable prefix."""
from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_PREFIX = "decodelab"


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    @classmethod
    def from_env(cls) -> Keys:
        return cls(os.environ.get("DECODELAB_REDIS_PREFIX", DEFAULT_PREFIX))

    @property
    def stream(self) -> str:  # requests: XADD by clients, XREADGROUP by replicas
        return f"{self.prefix}:requests"

    @property
    def group(self) -> str:  # the one consumer group; every replica is a consumer
        return f"{self.prefix}:replicas"

    @property
    def streams(self) -> str:  # set: every request stream (the shared one and each replica's), for claims and steals
        return f"{self.prefix}:streams"

    @property
    def live(self) -> str:  # sorted set: replica name -> heartbeat expiry (unix ms); routers list replicas here
        return f"{self.prefix}:live"

    def replica_stream(self, name: str) -> str:  # requests routed to one replica (same group, stealable)
        return f"{self.prefix}:requests:{name}"

    def kv_blocks(self, name: str) -> str:  # set: the block hashes in replica's prefix cache (its KV events)
        return f"{self.prefix}:kvblocks:{name}"

    def tokenizer(self, model: str) -> str:  # hash: file name -> text of the model's tokenizer files, for routers
        return f"{self.prefix}:tokenizer:{model}"

    def kv_transfer(self, request_id: str) -> str:  # a prefill replica's KV blocks for the decode replica, with a TTL
        return f"{self.prefix}:kvx:{request_id}"

    def affinity(self, route_key: str) -> str:  # the replica a route key (a playground run, a chat) went to last
        return f"{self.prefix}:affinity:{route_key}"

    @property
    def dead_letter(self) -> str:  # requests that crashed replicas max_attempts times, kept for a person to read
        return f"{self.prefix}:dead"

    @property
    def cancel_channel(self) -> str:  # pub/sub: request ids to abort
        return f"{self.prefix}:cancel"

    def events(self, request_id: str) -> str:  # pub/sub: TokenEvent ... DoneEvent | ErrorEvent
        return f"{self.prefix}:events:{request_id}"

    def result(self, request_id: str) -> str:  # the terminal event, with a TTL: the source of truth
        return f"{self.prefix}:result:{request_id}"

    def cancelled(self, request_id: str) -> str:  # cancel mark for a request still queued
        return f"{self.prefix}:cancelled:{request_id}"

    def attempt(self, request_id: str) -> str:  # INCR per pickup: attempt number of the run
        return f"{self.prefix}:attempt:{request_id}"

    def owner(self, request_id: str) -> str:  # replica running it, kept alive by its heartbeat
        return f"{self.prefix}:owner:{request_id}"

    def client(self, client_id: str) -> str:  # sorted set: the client's queued or running request ids, by expiry
        return f"{self.prefix}:client:{client_id}"

    def replica(self, name: str) -> str:  # replica heartbeat: model name and load, with a TTL
        return f"{self.prefix}:replica:{name}"

    def kv(self, name: str) -> str:  # replica's KV-cache snapshot (shared.monitor.KVSnapshot), with a TTL
        return f"{self.prefix}:kv:{name}"

    def steps(self, name: str) -> str:  # stream: replica's engine steps (shared.monitor.StepRecord), capped, with a TTL
        return f"{self.prefix}:steps:{name}"

    def shared_run(self, run_id: str) -> str:  # a playground run saved for a link (?run=<id>), with a TTL
        return f"{self.prefix}:run:{run_id}"
