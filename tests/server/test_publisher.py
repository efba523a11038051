"""The publisher thread's sends against a real Redis: order, what each item writes, a refused command, a connection
the server closed while idle."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict

import pytest
import redis

from engine_service.engine.roofline import StepRecord as EngineStep
from engine_service.server import publisher as publisher_mod
from engine_service.server.config import ReplicaConfig
from engine_service.server.jobs import AppendSteps, Finish, KVEvents, Publish, StoreSnapshot
from engine_service.server.publisher import Publisher, step_json
from engine_service.server.state import ReplicaState
from shared.monitor import StepRecord
from shared.protocol import DoneEvent, decode_event, encode


def _step(n: int) -> EngineStep:
    return EngineStep(step=n, start=1.7e9 + n / 1e3, seconds=0.0123, prefill_tokens=0, decode_tokens=3, num_seqs=3,
                      request_ids=["a", "b", "c"], flops=2_700_000_000 + n, bytes=140_000_000)


@pytest.fixture
def publisher(redis_server, keys):
    r = redis.Redis.from_url(redis_server.url)
    state = ReplicaState(engine=None, cfg=ReplicaConfig(redis_server.url, keys=keys, name="rep-1"), metrics=None,
                         redis=r, stats=None)
    publisher = Publisher(state)
    yield publisher
    publisher.close()
    r.close()


@pytest.fixture
def listen(sync_redis):
    ps = sync_redis.pubsub()
    yield ps
    ps.close()


def _messages(ps, n: int, timeout: float = 5.0) -> list[str]:
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        if (msg := ps.get_message(timeout=0.1)) is not None and msg["type"] == "message":
            out.append(msg["data"])
    return out


def test_step_json_is_the_shared_schema():
    rec = _step(7)
    assert StepRecord.model_validate_json(step_json(rec)) == StepRecord(**asdict(rec))


def test_items_are_written_in_order(publisher, listen, sync_redis, keys):
    listen.subscribe(keys.events("r1"))
    listen.get_message(timeout=1)  # the subscription's confirmation
    terminal = encode(DoneEvent(request_id="r1", seq=2, attempt=1, finish_reason="length", text="", outputs=[]))
    stream = keys.replica_stream("rep-1")
    entry = sync_redis.xadd(stream, {"r": "x"})
    publisher._send([
        Publish("r1", "token-0"),
        AppendSteps(keys.steps("rep-1"), [_step(1), _step(2)]),
        KVEvents([(True, "h1"), (True, "h2"), (False, "h1")]),
        StoreSnapshot(keys.kv("rep-1"), "snapshot"),
        Publish("r1", "token-1"),
        Finish("r1", entry, stream, terminal, "client-1"),
    ])
    assert _messages(listen, 3) == ["token-0", "token-1", terminal]
    steps = [StepRecord.model_validate_json(v["r"]) for _, v in sync_redis.xrange(keys.steps("rep-1"))]
    assert steps == [StepRecord(**asdict(_step(1))), StepRecord(**asdict(_step(2)))]
    assert 0 < sync_redis.pttl(keys.steps("rep-1")) <= 600_000
    assert sync_redis.smembers(keys.kv_blocks("rep-1")) == {"h2"}
    assert sync_redis.get(keys.kv("rep-1")) == "snapshot" and 0 < sync_redis.pttl(keys.kv("rep-1")) <= 6000
    assert decode_event(sync_redis.get(keys.result("r1"))).finish_reason == "length"


def test_a_refused_command_costs_that_command_only(publisher, listen, sync_redis, keys, caplog):
    sync_redis.set(keys.steps("rep-1"), "not a stream")  # XADD on it: WRONGTYPE
    listen.subscribe(keys.events("r1"))
    listen.get_message(timeout=1)
    with caplog.at_level(logging.ERROR, logger="decodelab.replica"):
        publisher._send([Publish("r1", "before"), AppendSteps(keys.steps("rep-1"), [_step(1)]),
                         Publish("r1", "after")])
        publisher._send([Publish("r1", "next send")])  # the connection stayed in step
    assert _messages(listen, 3) == ["before", "after", "next send"]
    assert "refused XADD" in caplog.text


def _publisher_connection(sync_redis) -> int:
    """The id of the publisher's own connection (it names itself after the replica)."""
    (conn,) = [c["id"] for c in sync_redis.client_list() if c["name"] == "rep-1:publisher"]
    return conn


def test_a_connection_the_server_closed_is_replaced(publisher, listen, sync_redis, keys, monkeypatch):
    monkeypatch.setattr(publisher_mod, "IDLE_CHECK_S", 0.0)  # (the check runs after a pause; every send here)
    listen.subscribe(keys.events("r1"))
    listen.get_message(timeout=1)
    publisher._send([Publish("r1", "one")])
    # its connection dies while idle (a server `timeout`, a proxy): the next send opens another, losing nothing
    assert sync_redis.client_kill_filter(_id=_publisher_connection(sync_redis)) == 1
    publisher._send([Publish("r1", "two")])
    assert _messages(listen, 2) == ["one", "two"]


def test_a_connection_that_breaks_mid_send_raises_and_the_next_send_reconnects(publisher, listen, sync_redis, keys):
    listen.subscribe(keys.events("r1"))
    listen.get_message(timeout=1)
    publisher._send([Publish("r1", "one")])
    assert sync_redis.client_kill_filter(_id=_publisher_connection(sync_redis)) == 1
    with pytest.raises(redis.ConnectionError):  # not idle: no check; `run` keeps the results and retries
        publisher._send([Publish("r1", "lost")])
    publisher._send([Publish("r1", "three")])
    assert _messages(listen, 2) == ["one", "three"]
