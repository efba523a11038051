"""The control thread: cancellations (the cancel channel) and heartbeats (keeps this replica's pending entries
fresh so nobody claims them, notices entries another replica claimed, publishes the replica's presence, keeps its
prefix-cache set and its tokenizer in Redis for routers)."""
from __future__ import annotations

import logging
import time

from pydantic import BaseModel
from redis.exceptions import ResponseError

from engine_service.server.jobs import Cancel, Drop
from engine_service.server.state import CONN_ERRORS, ReplicaState
from shared.protocol import encode
from shared.routing import tokenizer_files
from shared.scripts import HEARTBEAT, REMOVE_DEAD_CONSUMER, REMOVE_ORPHAN_STREAM

log = logging.getLogger("decodelab.replica")


class ReplicaInfo(BaseModel):
    model: str
    running: int
    capacity: int
    precision: str = ""  # what the playground shows beside the model: "int8 weights", "float32", "..., int8 KV"
    draft_model: str = ""  # the engine's --draft-model ("": none): the playground offers the draft proposer then
    roofs: dict | None = None  # measured at start-up (engine/roofline.py Roofs): flops_per_s, bytes_per_s, kind, ...
    accepting: bool = True  # pulling new requests (False while draining): routers send it nothing then
    block_size: int = 16  # of its KV cache: routers hash prompts in blocks of this size
    max_model_len: int = 0  # prompt + output tokens it takes (0: not said); the API's /v1/models shows it
    role: str = "both"  # both | prefill | decode (prefill/decode disaggregation): routers send new requests to
    # prefill and both replicas; prefill replicas hand requests to decode replicas


def precision(config) -> str:
    weights = "int8 weights" if config.quantization == "int8" else config.dtype
    kv = {"int8": ", int8 KV", "fp16": ", fp16 KV"}.get(config.kv_cache_dtype, "")
    return weights + kv


class Control:
    def __init__(self, state: ReplicaState):
        self.s = state
        self._heartbeat = state.redis.register_script(HEARTBEAT)
        self._remove_consumer = state.redis.register_script(REMOVE_DEAD_CONSUMER)
        self._remove_stream = state.redis.register_script(REMOVE_ORPHAN_STREAM)
        self._tokenizer: dict[str, str] | None = None  # its files, for routers (published while missing)
        self._redis_run_id: str | None = None  # a new one: Redis restarted (or failed over) and lost our sets

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

    def announce(self) -> None:
        """A heartbeat now, from the caller's thread (a drain starting: routers must see `accepting` false)."""
        try:
            self._beat()
        except CONN_ERRORS as e:
            log.warning("control: could not announce the replica's state (%s)", e)

    def remove_dead_consumers(self) -> list[str]:
        """Forget group consumers that hold nothing, have no heartbeat and were idle for consumer_gc_idle_s: replicas
        that are gone (a consumer lives in the group until deleted). A live replica re-creates itself on its next
        read. A gone replica's own stream goes too once it is empty (routers send nothing to a dead replica)."""
        s, keys = self.s, self.s.keys
        removed = []
        for stream in sorted(s.redis.smembers(keys.streams) | {keys.stream}):
            try:
                consumers = s.redis.xinfo_consumers(stream, keys.group)
            except ResponseError:  # NOGROUP: a stream deleted meanwhile
                continue
            for c in consumers:
                name = c["name"]
                if name == s.cfg.name or c["pending"] or c["idle"] < s.cfg.consumer_gc_idle_s * 1000:
                    continue
                if self._remove_consumer(keys=[stream, keys.replica(name)],
                                         args=[keys.group, name, int(s.cfg.consumer_gc_idle_s * 1000)]):
                    removed.append(name)
            owner = stream.removeprefix(keys.replica_stream(""))
            if stream != keys.stream and owner != s.cfg.name:
                self._remove_stream(keys=[stream, keys.replica(owner), keys.streams])
        if removed:
            log.info("removed %d dead consumers from the group: %s", len(removed), ", ".join(removed))
        return removed

    def _beat(self) -> None:
        s, keys = self.s, self.s.keys
        jobs = list(s.jobs.values())
        by_stream: dict[str, list] = {}
        for job in jobs:
            by_stream.setdefault(job.stream, []).append(job)
        lost = []
        for stream, held in by_stream.items():
            args = [keys.group, s.cfg.name, keys.owner(""), int(s.cfg.claim_idle_s * 2000)]
            for job in held:
                args += [job.entry_id, job.rid]
            lost += self._heartbeat(keys=[stream], args=args)
        for rid in lost:
            if (job := s.jobs.get(rid)) is not None:
                log.warning("request %s was claimed by another replica; dropping it here", rid)
                s.commands.put(Drop(job))
        ttl_ms = int(s.cfg.heartbeat_s * 3000)
        info = ReplicaInfo(model=s.cfg.model_name, running=len(jobs), capacity=s.capacity(),
                           precision=precision(s.engine.config), draft_model=s.engine.config.draft_model or "",
                           roofs=s.roofs, accepting=s.pulling.is_set(), block_size=s.engine.config.block_size,
                           max_model_len=s.engine.max_model_len, role=s.cfg.role)
        run_id = s.redis.info("server").get("run_id")
        if run_id != self._redis_run_id:  # a Redis we have not published to: the prefix-cache set goes whole
            self._redis_run_id = run_id
            s.kv_resync.set()
        pipe = s.redis.pipeline(transaction=False)
        pipe.set(keys.replica(s.cfg.name), encode(info), px=ttl_ms)
        (sec, usec) = s.redis.time()
        now_ms = sec * 1000 + usec // 1000
        pipe.zadd(keys.live, {s.cfg.name: now_ms + ttl_ms})
        pipe.zremrangebyscore(keys.live, "-inf", now_ms)  # replicas whose heartbeat ran out
        pipe.pexpire(keys.kv_blocks(s.cfg.name), s.cfg.kv_blocks_ttl_ms)
        pipe.exists(keys.tokenizer(s.cfg.model_name))
        for stream in (keys.stream, s.cfg.own_stream):
            pipe.xlen(stream)
            pipe.xpending(stream, keys.group)
        _, _, _, kv_alive, has_tokenizer, *lengths = pipe.execute(raise_on_error=False)
        s.queue_length = sum(max(0, length - pending["pending"]) for length, pending in zip(lengths[::2], lengths[1::2])
                             if isinstance(length, int) and isinstance(pending, dict))
        if kv_alive == 0 and s.stats.blocks_cached:  # the set expired or was deleted: publish it whole again
            s.kv_resync.set()
        if has_tokenizer == 0:
            self._publish_tokenizer()
        s.redis_ok = True

    def _publish_tokenizer(self) -> None:
        """The model's tokenizer files under keys.tokenizer(model), so that fronts without the model can route."""
        s = self.s
        if not s.cfg.model_name:
            return
        if self._tokenizer is None:
            self._tokenizer = tokenizer_files(s.engine.tokenizer)
        key = s.keys.tokenizer(s.cfg.model_name)
        pipe = s.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=self._tokenizer)
        pipe.expire(key, 24 * 3600)
        pipe.execute()
