"""The control thread: cancellations (the cancel channel) and heartbeats (keeps this replica's pending entries
fresh so nobody claims them, notices entries another replica claimed, publishes the replica's presence)."""
from __future__ import annotations

import logging
import time

from pydantic import BaseModel

from engine_service.server.jobs import Cancel, Drop
from engine_service.server.state import CONN_ERRORS, ReplicaState
from shared.protocol import encode
from shared.scripts import HEARTBEAT, REMOVE_DEAD_CONSUMER

log = logging.getLogger("decodelab.replica")


class ReplicaInfo(BaseModel):
    model: str
    running: int
    capacity: int
    precision: str = ""  # what the playground shows beside the model: "int8 weights", "float32", "..., int8 KV"
    draft_model: str = ""  # the engine's --draft-model ("": none): the playground offers the draft proposer then
    roofs: dict | None = None  # measured at start-up (engine/roofline.py Roofs): flops_per_s, bytes_per_s, kind, ...


def precision(config) -> str:
    weights = "int8 weights" if config.quantization == "int8" else config.dtype
    return weights + (", int8 KV" if config.kv_cache_dtype == "int8" else "")


class Control:
    def __init__(self, state: ReplicaState):
        self.s = state
        self._heartbeat = state.redis.register_script(HEARTBEAT)
        self._remove_consumer = state.redis.register_script(REMOVE_DEAD_CONSUMER)

    def run(self) -> None:
        s = self.s
        pubsub, last_beat, last_gc, delay = None, 0.0, time.monotonic(), 0.1
        while not s.stop.is_set():
            try:
                if pubsub is None:
                    pubsub = s.redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(s.keys.cancel_channel)
                    # Redis confirms the SUBSCRIBE in order: from here every cancel published reaches us
                    pubsub.get_message(timeout=2.0, ignore_subscribe_messages=False)
                    s.listening.set()
                msg = pubsub.get_message(timeout=0.1)
                if msg and msg["type"] == "message" and (job := s.jobs.get(msg["data"])) is not None:
                    job.cancelled = True
                    s.commands.put(Cancel(job))
                if time.monotonic() - last_beat >= s.cfg.heartbeat_s:
                    last_beat = time.monotonic()
                    self._beat()
                if time.monotonic() - last_gc >= min(60.0, s.cfg.consumer_gc_idle_s / 2):
                    last_gc = time.monotonic()
                    self.remove_dead_consumers()
                delay = 0.1
            except CONN_ERRORS as e:
                s.redis_ok = False
                log.warning("control: Redis unreachable (%s)", e)
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass
                pubsub = None
                s.stop.wait(delay)
                delay = min(2 * delay, 2.0)
            except Exception:  # e.g. a script error: keep cancelling and heart-beating
                log.exception("control")
                s.stop.wait(delay)
        if pubsub is not None:
            pubsub.close()

    def remove_dead_consumers(self) -> list[str]:
        """Forget group consumers that hold nothing, have no heartbeat and were idle for consumer_gc_idle_s: replicas
        that are gone (a consumer lives in the group until deleted). A live replica re-creates itself on its next
        read."""
        s, keys = self.s, self.s.keys
        removed = []
        for c in s.redis.xinfo_consumers(keys.stream, keys.group):
            name = c["name"]
            if name == s.cfg.name or c["pending"] or c["idle"] < s.cfg.consumer_gc_idle_s * 1000:
                continue
            if self._remove_consumer(keys=[keys.stream, keys.replica(name)],
                                     args=[keys.group, name, int(s.cfg.consumer_gc_idle_s * 1000)]):
                removed.append(name)
        if removed:
            log.info("removed %d dead consumers from the group: %s", len(removed), ", ".join(removed))
        return removed

    def _beat(self) -> None:
        s, keys = self.s, self.s.keys
        jobs = list(s.jobs.values())
        args = [keys.group, s.cfg.name, keys.owner(""), int(s.cfg.claim_idle_s * 2000)]
        for job in jobs:
            args += [job.entry_id, job.rid]
        lost = self._heartbeat(keys=[keys.stream], args=args) if jobs else []
        for rid in lost:
            if (job := s.jobs.get(rid)) is not None:
                log.warning("request %s was claimed by another replica; dropping it here", rid)
                s.commands.put(Drop(job))
        pipe = s.redis.pipeline(transaction=False)
        info = ReplicaInfo(model=s.cfg.model_name, running=len(jobs), capacity=s.capacity(),
                           precision=precision(s.engine.config), draft_model=s.engine.config.draft_model or "",
                           roofs=s.roofs)
        pipe.set(keys.replica(s.cfg.name), encode(info), px=int(s.cfg.heartbeat_s * 3000))
        pipe.xlen(keys.stream)
        pipe.xpending(keys.stream, keys.group)
        _, length, pending = pipe.execute(raise_on_error=False)
        if isinstance(length, int) and isinstance(pending, dict):
            s.queue_length = max(0, length - pending["pending"])
        s.redis_ok = True
