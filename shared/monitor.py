"""Read-only views of the service in Redis for dashboards (the playground): replicas, queue position, KV snapshots,
engine steps.

Replicas publish a `KVSnapshot` under `Keys.kv(name)` a few times per second while busy (with a TTL);
the web reads it to draw the block map. Each replica also appends one `StepRecord` per engine step to the stream
`Keys.steps(name)` (capped near STEPS_MAXLEN entries, with a TTL); the web reads the records of its own requests to
draw the roofline. Nothing here changes the service's state.
"""
from __future__ import annotations

import json
from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.keys import Keys

KV_SNAPSHOT_VERSION = 1
KV_MAP_LIMIT = 1024  # most block ids a snapshot's map covers (the lowest ids: the allocator hands those out first)
STEPS_MAXLEN = 2000  # step records a replica's stream keeps (XADD MAXLEN ~: Redis trims in whole nodes, so a few more)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class KVSeq(_Model):
    """One sequence in the engine (a request has n of them: samples, beams) and the blocks it holds."""

    request_id: str
    index: int = 0
    status: Literal["running", "waiting"] = "running"
    tokens: int = 0  # prompt + generated
    computed: int = 0  # tokens whose K/V are in the cache
    cached_prompt_tokens: int = 0  # of the prompt, found in the prefix cache when it was scheduled
    blocks: list[int] = Field(default_factory=list)  # its block table, in order


class KVSnapshot(_Model):
    v: int = KV_SNAPSHOT_VERSION
    replica: str
    model: str = ""
    at: float  # unix time taken
    block_size: int
    stats: dict[str, float] = Field(default_factory=dict)  # engine.stats(): blocks_*, prefix_*, cow_copies, ...
    map_size: int  # the map covers block ids [0, map_size)
    cached: list[int] = Field(default_factory=list)  # ids < map_size registered in the prefix cache
    seqs: list[KVSeq] = Field(default_factory=list)


class StepRecord(_Model):
    """One engine step (engine_service/engine/roofline.py): its tokens, its time, and the FLOPs and bytes the cost
    model gives it."""

    step: int  # the replica engine's step number (from 1)
    start: float  # unix time the step began
    seconds: float
    prefill_tokens: int  # prompt tokens (and tokens recomputed after a preemption)
    decode_tokens: int  # one per decoding sequence, plus the speculative draft tokens verified
    num_seqs: int
    request_ids: list[str] = Field(default_factory=list)
    flops: int
    bytes: int


def _s(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _scan(r: aioredis.Redis, pattern: str, limit: int = 256) -> list[str]:
    found: list[str] = []
    async for key in r.scan_iter(match=pattern, count=100):
        found.append(_s(key))
        if len(found) >= limit:
            break
    return sorted(found)


async def replicas(r: aioredis.Redis, keys: Keys) -> dict[str, dict]:
    """Live replicas (their heartbeat keys): name -> {"model", "running", "capacity", "precision", "draft_model"}."""
    names = await _scan(r, keys.replica("*"))
    if not names:
        return {}
    out = {}
    for key, raw in zip(names, await r.mget(names)):
        if raw is None:
            continue  # expired between SCAN and MGET
        try:
            out[key.removeprefix(keys.replica(""))] = json.loads(raw)
        except ValueError:
            continue
    return out


async def kv_snapshots(r: aioredis.Redis, keys: Keys) -> list[KVSnapshot]:
    names = await _scan(r, keys.kv("*"))
    if not names:
        return []
    out = []
    for raw in await r.mget(names):
        if raw is None:
            continue
        try:
            out.append(KVSnapshot.model_validate_json(raw))
        except ValidationError:
            continue
    return out


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def queue_position(r: aioredis.Redis, keys: Keys, entry_id: str, stream: str | None = None,
                         limit: int = 1000) -> int | None:
    """1-based place of a stream entry among those no replica has taken yet; None once a replica took it."""
    stream = stream or keys.stream
    groups = await r.xinfo_groups(stream)
    group = next((g for g in groups if _s(g.get("name", "")) == keys.group), None)
    last = _s(group.get("last-delivered-id", "0-0")) if group else "0-0"
    if _stream_id(entry_id) <= _stream_id(last):
        return None
    ahead = await r.xrange(stream, min=f"({last}", max=entry_id, count=limit)
    return max(1, len(ahead))


def stream_id_at(unix_time: float) -> str:
    """The first stream id Redis could give an entry added at `unix_time` (ids start with the milliseconds)."""
    return f"{max(0, int(unix_time * 1000))}-0"


async def steps(r: aioredis.Redis, keys: Keys, replica: str, since_id: str = "0-0",
                count: int = 500) -> tuple[list[StepRecord], str]:
    """The replica's step records after `since_id` (exclusive), oldest first, at most `count`; and the id to read on
    from next time (`since_id` when there was nothing new). Malformed entries are skipped."""
    entries = await r.xrange(keys.steps(replica), min=f"({since_id}", max="+", count=count)
    out = []
    for entry_id, fields in entries:
        since_id = _s(entry_id)
        raw = fields.get("r", fields.get(b"r"))
        if raw is None:
            continue
        try:
            out.append(StepRecord.model_validate_json(raw))
        except ValidationError:
            continue
    return out, since_id
