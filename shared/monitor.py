"""Read-only views of the service in Redis for dashboards (the playground): replicas, queue position, KV snapshots.

Replicas publish a `KVSnapshot` under `Keys.kv(name)` a few times per second while busy (with a TTL);
the web reads it to draw the block map. Nothing here changes the service's state.
"""
from __future__ import annotations

import json
from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.keys import Keys

KV_SNAPSHOT_VERSION = 1
KV_MAP_LIMIT = 1024  # most block ids a snapshot's map covers (the lowest ids: the allocator hands those out first)


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
    """Live replicas (their heartbeat keys): name -> {"model", "running", "capacity"}."""
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


async def queue_position(r: aioredis.Redis, keys: Keys, entry_id: str, limit: int = 1000) -> int | None:
    """1-based place of a stream entry among those no replica has taken yet; None once a replica took it."""
    groups = await r.xinfo_groups(keys.stream)
    group = next((g for g in groups if _s(g.get("name", "")) == keys.group), None)
    last = _s(group.get("last-delivered-id", "0-0")) if group else "0-0"
    if _stream_id(entry_id) <= _stream_id(last):
        return None
    ahead = await r.xrange(keys.stream, min=f"({last}", max=entry_id, count=limit)
    return max(1, len(ahead))
