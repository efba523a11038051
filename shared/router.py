"""Prefix-aware routing: which replica's queue a request goes to, from the replicas' KV events and their load.

Every replica keeps, in Redis, the set of block hashes its prefix cache holds (`keys.kv_blocks(name)`, kept by its
KV events) and a heartbeat (`keys.replica(name)`, listed in `keys.live`). For a request, the router computes the
prompt's block hashes (shared/routing.py) and, in one pipelined round trip, asks each live replica's set which of
them it holds (SMISMEMBER), how many requests wait or run in its own stream (XLEN) and what its heartbeat says. The
cost of a replica is the prompt tokens it would have to prefill plus `load_weight` tokens for each request it holds
(NVIDIA Dynamo's "prefill blocks + decode blocks", in tokens); the cheapest wins. Replicas holding `imbalance` more
requests than the least loaded one are skipped (SGLang's guard against hot prefixes piling onto one replica): the
others prefill the hot prefix once and share the load from then on.

A route key (a playground run, a chat's `prompt_cache_key`) sends requests that belong together to the replica the
key went to last, while that replica lives and is not overloaded: the playground's four columns and every branch of
a run share one replica's cache even before the first column's prefill has published its blocks.

Routing is a hint, never a promise: the request is queued on the chosen replica's stream, which every replica reads
with the same consumer group. A replica that dies, drains or falls behind has its queue taken by the others
(engine_service/server/intake.py: claims and steals), and one completion per request is still enforced by the
finish script. With no live replica, or routing off, the request goes to the shared stream.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.keys import Keys
from shared.protocol import GenerationRequest
from shared.routing import block_hashes, load_tokenizer, prompt_token_ids

log = logging.getLogger("decodelab.router")
MAX_ROUTED_BLOCKS = 512  # hashes looked up per request: past this the prefix is long enough to decide


@dataclass(frozen=True)
class Route:
    stream: str  # where the request is queued
    replica: str | None  # the replica chosen; None: the shared stream
    cached_tokens: int  # prompt tokens the chosen replica holds (per its KV events)
    reason: str  # "prefix" (held the longest prefix, net of load), "load", "affinity", "shared"
    seconds: float  # the decision's cost: tokenising, the Redis round trip, scoring


@dataclass
class Candidate:
    name: str
    block_size: int
    load: int  # requests routed to it and not finished (its stream's length), or running, whichever is more
    cached_tokens: int = 0
    role: str = "both"


def routing_enabled() -> bool:
    return os.environ.get("DECODELAB_ROUTING", "1") not in ("0", "false", "off")


class Router:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, load_weight: float | None = None,
                 imbalance: int | None = None, affinity_ttl_s: int = 600, live_cache_s: float = 0.5):
        env = os.environ.get
        self.redis, self.keys = redis, keys
        self.load_weight = load_weight if load_weight is not None else float(env("DECODELAB_ROUTE_LOAD_WEIGHT", 128))
        self.imbalance = imbalance if imbalance is not None else int(env("DECODELAB_ROUTE_IMBALANCE", 8))
        self.affinity_ttl_s, self.live_cache_s = affinity_ttl_s, live_cache_s
        self._live: tuple[float, list[str]] = (0.0, [])
        self._tokenizers: dict[str, object] = {}  # model -> tokenizer, or the task loading it
        self._tried: set[str] = set()  # models whose published tokenizer was loaded, or failed to load
        self._model: str | None = None  # the model the live replicas serve (their heartbeats), once seen
        self._block_sizes: dict[str, int] = {}  # replica -> its block size, from its last heartbeat

    async def live_replicas(self) -> list[str]:
        at, names = self._live
        if time.monotonic() - at > self.live_cache_s:
            now_ms = int(time.time() * 1000)
            names = sorted(await self.redis.zrangebyscore(self.keys.live, now_ms, "+inf"))
            self._live = (time.monotonic(), names)
        return names

    def tokenizer(self, model: str):
        """The model's tokenizer once loaded from Redis (the first call starts loading it in the background)."""
        tok = self._tokenizers.get(model)
        if tok is None:
            self._tokenizers[model] = asyncio.ensure_future(self._load_tokenizer(model))
            return None
        return None if isinstance(tok, asyncio.Future) else tok

    async def loaded_tokenizer(self, model: str):
        """The model's tokenizer, waiting for it to load from Redis; None while no replica has published it."""
        self.tokenizer(model)
        if isinstance(loading := self._tokenizers.get(model), asyncio.Future):
            await asyncio.shield(loading)  # (a cancelled request must not cancel the load for the others)
        tok = self._tokenizers.get(model)
        return None if isinstance(tok, asyncio.Future) else tok

    def warm(self, model: str) -> None:
        """Start loading the model's tokenizer unless it is loaded or loading, or its published files failed to
        load before (then only a request tries again: a caller that polls must not retry a broken one each time)."""
        if model not in self._tried:
            self.tokenizer(model)

    async def preload(self, poll_s: float = 1.0) -> None:
        """Load the tokenizer of the model the live replicas serve before a request needs it, polling until one
        has published it. Loaded for the first request instead, transformers' import and the files (~0.7 s of the
        API process's CPU by py-spy) held that request's events up in this process."""
        while True:
            try:
                names = await self.live_replicas()
                beats = await self.redis.mget([self.keys.replica(n) for n in names]) if names else []
            except RedisError as e:
                log.debug("router: preload waits for Redis (%s)", e)
                beats = []
            for model in {info.get("model") for raw in beats if (info := _info(raw))} - {None}:
                self.warm(model)
            loading = [t for t in self._tokenizers.values() if isinstance(t, asyncio.Future)]
            await asyncio.gather(*loading)
            if self._tried:
                return
            await asyncio.sleep(poll_s)

    async def _load_tokenizer(self, model: str) -> None:
        try:
            files = await self.redis.hgetall(self.keys.tokenizer(model))
            if not files:  # no replica of this model has published it yet: try again on a later request
                self._tokenizers.pop(model, None)
                return
            self._tried.add(model)
            self._tokenizers[model] = await asyncio.to_thread(load_tokenizer, files)
            log.info("router: loaded the tokenizer of %s from Redis", model)
        except Exception as e:  # a broken tokenizer must not stop routing by load
            log.warning("router: no tokenizer for %s (%s); routing by load", model, e)
            self._tokenizers.pop(model, None)

    def token_ids(self, request: GenerationRequest, model: str) -> list[int] | None:
        if isinstance(request.prompt, list) and request.continuation is None:
            return list(request.prompt)  # nothing to tokenise
        tok = self.tokenizer(model)
        if tok is None:
            return None
        try:
            return prompt_token_ids(request, tok)
        except ValueError:
            return None  # the replica refuses it with the reason; any replica will do

    async def route(self, request: GenerationRequest, route_key: str | None = None) -> Route:
        """One pipelined round trip: every live replica's heartbeat, queue length and which of the prompt's blocks
        it holds (hashed with the block size its last heartbeat gave; a replica whose size differs is asked again)."""
        t0 = time.perf_counter()
        names = await self.live_replicas()
        if not names:
            return Route(self.keys.stream, None, 0, "shared", time.perf_counter() - t0)
        model = request.model or self._model
        ids = self.token_ids(request, model) if model else None
        guessed = {n: self._block_sizes.get(n, 16) for n in names}
        hashes = self._hashes(ids, set(guessed.values()))
        pipe = self.redis.pipeline(transaction=False)
        pipe.mget([self.keys.replica(n) for n in names])
        for n in names:
            pipe.xlen(self.keys.replica_stream(n))
            if hashes.get(guessed[n]):
                pipe.smismember(self.keys.kv_blocks(n), hashes[guessed[n]])
        if route_key:
            pipe.get(self.keys.affinity(route_key))
        beats, *rest = await pipe.execute()
        affinity = rest.pop() if route_key else None
        candidates, replies = [], iter(rest)
        for name, raw in zip(names, beats):
            n_queued = next(replies)
            held = next(replies) if hashes.get(guessed[name]) else None
            info = _info(raw)
            if info is None or not info.get("accepting", True):
                continue  # its heartbeat ran out, or it drains
            if request.model and info.get("model") != request.model:
                continue
            self._model = self._model or info.get("model")
            c = Candidate(name, int(info.get("block_size", 16)), max(int(n_queued), int(info.get("running", 0))),
                          role=info.get("role", "both"))
            self._block_sizes[name] = c.block_size
            if held is not None and c.block_size == guessed[name]:
                c.cached_tokens = _leading(held) * c.block_size
            candidates.append(c)
        if not candidates:
            return Route(self.keys.stream, None, 0, "shared", time.perf_counter() - t0)
        if any(c.role != "decode" for c in candidates):  # new requests start where prompts are computed
            candidates = [c for c in candidates if c.role != "decode"]
        if ids is None and self._model and (ids := self.token_ids(request, self._model)):
            await self._cached_prefixes(candidates, ids)  # the first request: the model was not known yet
        else:
            await self._cached_prefixes([c for c in candidates if c.block_size != guessed[c.name]], ids or [])
        chosen, reason = self._choose(candidates, len(ids or ()), affinity)
        if route_key:
            await self.redis.set(self.keys.affinity(route_key), chosen.name, ex=self.affinity_ttl_s)
        return Route(self.keys.replica_stream(chosen.name), chosen.name, chosen.cached_tokens, reason,
                     time.perf_counter() - t0)

    @staticmethod
    def _hashes(ids: list[int] | None, sizes: set[int]) -> dict[int, list[str]]:
        return {bs: block_hashes(ids, bs, MAX_ROUTED_BLOCKS) for bs in sizes} if ids else {}

    async def _cached_prefixes(self, candidates: list[Candidate], ids: list[int]) -> None:
        hashes = self._hashes(ids, {c.block_size for c in candidates})
        asked = [c for c in candidates if hashes.get(c.block_size)]
        if not asked:
            return
        pipe = self.redis.pipeline(transaction=False)
        for c in asked:
            pipe.smismember(self.keys.kv_blocks(c.name), hashes[c.block_size])
        for c, held in zip(asked, await pipe.execute()):
            c.cached_tokens = _leading(held) * c.block_size

    def _choose(self, candidates: list[Candidate], num_tokens: int, affinity: str | None) -> tuple[Candidate, str]:
        least = min(c.load for c in candidates)
        fair = [c for c in candidates if c.load - least <= self.imbalance]
        for c in fair:
            if c.name == affinity:
                return c, "affinity"
        random.shuffle(fair)  # equal costs: no replica is everyone's first choice
        best = min(fair, key=lambda c: (num_tokens - c.cached_tokens + self.load_weight * c.load, c.load))
        return best, ("prefix" if best.cached_tokens else "load")


def _leading(held: list) -> int:
    """How many of the prompt's blocks, from the first on, a replica holds (a later block without the first is of
    no use)."""
    return next((i for i, h in enumerate(held) if not h), len(held))


def _info(raw: str | None) -> dict | None:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


async def safe_route(router: Router, request: GenerationRequest, route_key: str | None) -> Route | None:
    """`router.route`, or None (the shared stream) when Redis cannot answer the look-up."""
    try:
        return await router.route(request, route_key)
    except (RedisError, OSError) as e:
        log.warning("router: look-up failed (%s); using the shared stream", e)
        return None
