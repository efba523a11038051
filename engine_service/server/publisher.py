"""The publisher thread: pipelines token events (PUBLISH), KV snapshots (SET), engine step records (XADD to a capped
stream), KV events (SADD / SREM on the replica's set of cached block hashes, which routers read) and finishes (the
atomic script that stores the result, publishes it, acknowledges and deletes the entry and frees the client's
slot)."""
from __future__ import annotations

import json
import logging
import queue
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine_service.engine.roofline import StepRecord as EngineStep
from engine_service.server.jobs import (
    AppendSteps,
    Finish,
    HandOver,
    KVEvents,
    KVSync,
    OutboxItem,
    Publish,
    StoreSnapshot,
)
from engine_service.server.state import CONN_ERRORS, ReplicaState
from shared.monitor import STEPS_MAXLEN, StepRecord
from shared.protocol import PROTOCOL_VERSION, encode
from shared.scripts import FINISH, HANDOVER

log = logging.getLogger("decodelab.replica")

IDLE_CHECK_S = 1.0  # a send after a pause this long first checks that the server has not closed the connection


def step_json(record: EngineStep) -> str:
    """An engine step record (engine/roofline.py) as the shared schema's JSON: its fields by the schema's names,
    without building and validating the pydantic model on the way out (readers validate it)."""
    return json.dumps({name: getattr(record, name) for name in StepRecord.model_fields})


class Publisher:
    def __init__(self, state: ReplicaState):
        self.s = state
        self._finish = state.redis.register_script(FINISH)
        self._handover = state.redis.register_script(HANDOVER)
        self._conn = None  # the connection `_run` writes on (made on first use, re-made after a failure)
        self._used_at = 0.0

    def _take(self, pending: list[OutboxItem]) -> None:
        """Wait briefly for one item, then take whatever else is queued (up to 512 a pipeline)."""
        try:
            pending.append(self.s.outbox.get(timeout=0.1))
        except queue.Empty:
            return
        while len(pending) < 512:
            try:
                pending.append(self.s.outbox.get_nowait())
            except queue.Empty:
                return

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None

    def _loop(self) -> None:
        s = self.s
        pending: list[OutboxItem] = []
        delay = 0.05
        while not (s.stop.is_set() and not pending and s.outbox.empty()):
            self._take(pending)
            if not pending:
                continue
            try:
                self._send(pending)
                pending, delay = [], 0.05
            except CONN_ERRORS as e:
                # Token events lost in an outage are repaired by clients from the result key; results are kept.
                pending = [item for item in pending if isinstance(item, Finish)]
                log.warning("publish: Redis unreachable (%s); %d results held", e, len(pending))
                if s.stop.wait(delay) and delay >= 1.0:
                    return
                delay = min(2 * delay, 1.0)

    def _send(self, items: list[OutboxItem]) -> None:
        """Everything queued, in order: plain commands in one round trip (`_run`), finishes in a pipeline (their
        script may need loading), the KV set's rewrite and a hand-over each between them."""
        s, keys = self.s, self.s.keys
        cmds: list[tuple] = []
        finishes = None
        for item in items:
            if isinstance(item, Finish):
                self._run(cmds)
                if finishes is None:
                    finishes = s.redis.pipeline(transaction=False)
                rid = item.request_id
                self._finish(keys=[keys.result(rid), keys.events(rid), item.stream, keys.owner(rid),
                                   keys.client(item.client_id)],
                             args=[keys.group, item.entry_id, item.payload, s.cfg.result_ttl_s, rid], client=finishes)
                continue
            if finishes is not None:
                self._execute(finishes)
                finishes = None
            if isinstance(item, Publish):
                cmds.append(("PUBLISH", keys.events(item.request_id), item.payload))
            elif isinstance(item, StoreSnapshot):
                cmds.append(("SET", item.key, item.payload, "PX", int(s.cfg.kv_snapshot_ttl_s * 1000)))
            elif isinstance(item, AppendSteps):
                for record in item.records:  # approximate trimming: Redis drops whole nodes, O(1) per add
                    cmds.append(("XADD", item.key, "MAXLEN", "~", STEPS_MAXLEN, "*", "r", step_json(record)))
                cmds.append(("PEXPIRE", item.key, int(s.cfg.steps_ttl_s * 1000)))
            elif isinstance(item, KVEvents):
                key = keys.kv_blocks(s.cfg.name)
                for stored, name in item.events:  # in order: a hash evicted and stored again ends stored
                    cmds.append(("SADD" if stored else "SREM", key, name))
                cmds.append(("PEXPIRE", key, s.cfg.kv_blocks_ttl_ms))
            elif isinstance(item, KVSync):
                self._run(cmds)  # what came before, then the set rewritten in one transaction
                self._sync_kv(item.names)
            else:
                self._run(cmds)
                self._hand_over(item)
        self._run(cmds)
        if finishes is not None:
            self._execute(finishes)

    def _run(self, cmds: list[tuple]) -> None:
        """Send the commands in one write and read their replies, then empty the list.

        What `pipeline().execute()` does, on the publisher's own connection, without the per-command bookkeeping
        that made redis-py's pipeline ~3x the CPU of the commands themselves, nor the pool's checks and counters
        on every borrow (~25 us a token: a token's PUBLISH went ~0.26 -> ~0.08 -> ~0.05 ms on the 2-core target,
        a core the engine's threads want). A refused command is logged and the rest still read (the connection
        stays in step); a broken connection is dropped and raises (`run` keeps the results and drops the rest; the
        next send connects again).
        """
        if not cmds:
            return
        conn = self._conn
        if conn is None:
            pool = self.s.redis.connection_pool
            conn = self._conn = pool.connection_class(**{**pool.connection_kwargs,
                                                         "client_name": f"{self.s.cfg.name}:publisher"})
        elif time.monotonic() - self._used_at > IDLE_CHECK_S:
            # what the pool checks on every borrow, only after a pause: a connection the server closed while it
            # sat idle (a `timeout` in its config, a restart) reads as readable; re-made, nothing queued is lost
            try:
                stale = conn.can_read()
            except (RedisConnectionError, RedisTimeoutError, OSError):
                stale = True
            if stale:
                conn.disconnect()
        self._used_at = time.monotonic()
        try:
            conn.send_packed_command(conn.pack_commands(cmds))  # (connects first when it is not)
            for cmd in cmds:
                try:
                    conn.read_response()
                except ResponseError as e:
                    log.error("publish: Redis refused %s: %s", cmd[0], e)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            cmds.clear()

    def _hand_over(self, item: HandOver) -> None:
        """The blocks to the connector, then the request to the least loaded decode replica's stream (the shared
        stream when there is none: any replica then decodes it whole)."""
        s, keys, job = self.s, self.s.keys, item.job
        target = self._decode_stream()
        handle = s.kv_connector.send(job.rid, item.blocks)
        self._handover(keys=[job.stream, target, keys.owner(job.rid), keys.attempt(job.rid), keys.streams],
                       args=[keys.group, job.entry_id, PROTOCOL_VERSION, job.rid, encode(job.request), handle,
                             s.cfg.name])

    def _decode_stream(self) -> str:
        s, keys = self.s, self.s.keys
        (sec, usec) = s.redis.time()
        names = s.redis.zrangebyscore(keys.live, sec * 1000 + usec // 1000, "+inf")
        infos = s.redis.mget([keys.replica(n) for n in names]) if names else []
        decoders = [n for n, raw in zip(names, infos) if raw and (i := json.loads(raw)).get("role") == "decode"
                    and i.get("accepting", True)]
        if not decoders:
            return keys.stream
        pipe = s.redis.pipeline(transaction=False)
        for n in decoders:
            pipe.xlen(keys.replica_stream(n))
        queued = pipe.execute()
        return keys.replica_stream(min(zip(queued, decoders))[1])

    def _sync_kv(self, names: list[str]) -> None:
        """Replace the published set of cached block hashes (a router never sees it half rewritten)."""
        s = self.s
        key = s.keys.kv_blocks(s.cfg.name)
        tx = s.redis.pipeline(transaction=True)
        tx.delete(key)
        for i in range(0, len(names), 4096):
            tx.sadd(key, *names[i:i + 4096])
        tx.pexpire(key, s.cfg.kv_blocks_ttl_ms)
        tx.execute()

    @staticmethod
    def _execute(pipe) -> None:
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):
                log.error("publish: Redis refused a command: %s", reply)
