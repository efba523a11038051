"""An engine replica: pulls requests from the Redis stream into the engine's running batch, streams tokens back.

Four threads, one role each (composition over a shared ReplicaState): `intake` (XREADGROUP / XAUTOCLAIM as free
capacity allows), `engine` (add/abort/step: the only thread touching the engine), `publish` (pipelines PUBLISH
and the atomic finish script), `control` (cancel channel, heartbeats). Redis I/O never runs on the engine thread.
"""
from __future__ import annotations

import logging
import threading
import time

import redis
from prometheus_client import CollectorRegistry

from engine_service.engine.roofline import engine_roofs
from engine_service.server.config import ReplicaConfig
from engine_service.server.control import Control
from engine_service.server.engine_loop import EngineLoop
from engine_service.server.intake import Intake
from engine_service.server.jobs import Drop
from engine_service.server.kv_connector import RedisKVConnector
from engine_service.server.metrics import ReplicaMetrics
from engine_service.server.publisher import Publisher
from engine_service.server.state import ReplicaState

HANDED_BACK_IDLE_MS = 365 * 24 * 3600 * 1000  # idle "forever": past any replica's claim_idle_s
log = logging.getLogger("decodelab.replica")


class Replica:
    def __init__(self, engine, config: ReplicaConfig, metrics: ReplicaMetrics | None = None):
        # encoding_errors="replace": a stream entry that is not UTF-8 becomes a refused request, not an intake error
        client = redis.Redis.from_url(config.redis_url, decode_responses=True, encoding_errors="replace",
                                      socket_connect_timeout=2, socket_timeout=config.read_block_ms / 1000 + 5,
                                      health_check_interval=5)
        self.state = ReplicaState(engine, config, metrics or ReplicaMetrics(CollectorRegistry()), client,
                                  engine.stats())
        self.state.kv_connector = RedisKVConnector(config.redis_url, config.keys, config.kv_transfer_ttl_s)
        self.state.pulling.set()
        # measured before serving (the engine would compete for the cores), once per process (roofline.py)
        roofs = engine_roofs(engine)
        self.state.roofs = roofs.to_dict()
        log.info("roofs (%d threads, %.2f s to measure): compute %.1f G%s/s (%s), memory %.1f GB/s, ridge %.1f "
                 "FLOP/byte", roofs.threads, roofs.seconds, roofs.flops_per_s / 1e9,
                 "op" if roofs.kind == "int8" else "FLOP", roofs.kind, roofs.bytes_per_s / 1e9, roofs.ridge)
        self.roles = {"intake": Intake(self.state), "engine": EngineLoop(self.state),
                      "publish": Publisher(self.state), "control": Control(self.state)}
        self._threads: list[threading.Thread] = []

    # the state the tests and the HTTP app read
    @property
    def engine(self):
        return self.state.engine

    @property
    def jobs(self):
        return self.state.jobs

    def start(self, listen_timeout: float = 5.0) -> Replica:
        """The threads; intake last, once the control thread listens for cancels (or after `listen_timeout`, when
        Redis is down: intake waits for it too): a cancel published while the first request is picked up, after
        its cancel mark was read, would otherwise reach no one."""
        for name, role in self.roles.items():
            if name == "intake":
                continue
            self._spawn(name, role)
        self.state.listening.wait(listen_timeout)
        self._spawn("intake", self.roles["intake"])
        # its first heartbeat before start() returns (and so before the API's /ready says 200): routers skip a
        # replica without one, so a client that sent work on /ready found no routable replica (seen in CI)
        self.roles["control"].announce()
        return self

    def _spawn(self, name: str, role) -> None:
        t = threading.Thread(target=role.run, name=f"replica-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def drain(self, timeout: float) -> bool:
        """Stop pulling and let running requests finish (True if all did within timeout). Its heartbeat says so at
        once: routers send it nothing more, and other replicas take what waits in its queue."""
        self.state.pulling.clear()
        self.roles["control"].announce()
        return self._wait_empty(timeout)

    def _wait_empty(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while self.state.jobs and time.monotonic() < end:
            time.sleep(0.05)
        return not self.state.jobs

    def hand_back(self, timeout: float = 5.0) -> int:
        """Give what still runs back to the stream for another replica, at once: stop running it here, then mark
        its entries long idle so the next XAUTOCLAIM of any replica takes them (without waiting claim_idle_s)."""
        s = self.state
        s.pulling.clear()
        self.roles["control"].announce()  # no longer accepting: routers stop sending, others take its queue
        jobs = list(s.jobs.values())
        for job in jobs:
            s.commands.put(Drop(job))
        self._wait_empty(timeout)
        if not jobs:
            return 0
        pipe = s.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.xclaim(job.stream, s.keys.group, s.cfg.name, 0, [job.entry_id], idle=HANDED_BACK_IDLE_MS,
                        justid=True)
            pipe.delete(s.keys.owner(job.rid))
        pipe.execute(raise_on_error=False)
        return len(jobs)

    def stop(self, timeout: float = 5.0) -> None:
        s = self.state
        s.pulling.clear()
        s.stop.set()
        s.commands.put(None)
        for t in self._threads:
            t.join(timeout)
        s.redis.close()
        s.kv_connector.close()  # its own connection pool (bytes, for KV transfers)
