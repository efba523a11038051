"""One click of Run: submit the columns' requests through Redis, stream them in parallel, watch the service.

Every wait is bounded: a dead engine or an unreachable Redis ends the run with a message in each column.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from redis.exceptions import RedisError

from shared import monitor
from shared.client import EngineClient, QueueFull
from shared.keys import Keys
from shared.monitor import KVSnapshot, StepRecord
from shared.protocol import new_request_id
from web.branches import Branch, BranchError, BranchTree, continuation
from web.columns import Column, Token
from web.modes import MODES, InputError, Settings, build_request, other_proposer

log = logging.getLogger("decodelab.web")
REPLICA_GONE_S = 6.0  # no replica heartbeat this long while requests are out: the engine is down
REDIS_GONE_S = 4.0
STOP_GRACE_S = 3.0  # after Stop, wait this long for the replica's "cancelled" before closing columns ourselves
PREFILL_WAIT_S = 30.0  # share-the-prompt: the others go anyway if greedy has no first token by then
STEPS_LOOKBACK_S = 60.0  # a run reads step records from this long before it started (clocks of hosts may differ)
STEP_PAGE, STEP_PAGES = 500, 4  # step records per read, reads per poll: a busy replica's backlog takes a few polls


class Service:
    """The web's handle on Redis: one EngineClient per event loop (redis.asyncio connections are loop-bound)."""

    def __init__(self, redis_url: str, keys: Keys | None = None, replica_gone_s: float = REPLICA_GONE_S,
                 redis_gone_s: float = REDIS_GONE_S):
        self.redis_url, self.keys = redis_url, keys or Keys.from_env()
        self.replica_gone_s, self.redis_gone_s = replica_gone_s, redis_gone_s
        self._clients: dict[int, EngineClient] = {}

    def client(self) -> EngineClient:
        loop = asyncio.get_running_loop()
        c = self._clients.get(id(loop))
        if c is None:
            c = self._clients[id(loop)] = EngineClient(self.redis_url, self.keys, recover_after=2.0)
        return c

    async def health(self) -> tuple[bool, dict[str, dict]]:
        """(Redis reachable?, live replicas)."""
        client = self.client()
        try:
            await asyncio.wait_for(client.redis.ping(), 2.0)
            live = await asyncio.wait_for(monitor.replicas(client.redis, self.keys), 2.0)
        except (TimeoutError, RedisError, OSError):
            return False, {}
        if client.router is not None:  # the page's load: its first Run must not wait for the tokenizer (router.py)
            for info in live.values():
                if info.get("model"):
                    client.router.warm(str(info["model"]))
        return True, live

    async def kv(self) -> list[KVSnapshot]:
        try:
            return await asyncio.wait_for(monitor.kv_snapshots(self.client().redis, self.keys), 2.0)
        except (TimeoutError, RedisError, OSError):
            return []

    async def steps(self, replica: str, since_id: str) -> tuple[list[StepRecord], str]:
        try:
            return await asyncio.wait_for(
                monitor.steps(self.client().redis, self.keys, replica, since_id, STEP_PAGE), 2.0)
        except (TimeoutError, RedisError, OSError):
            return [], since_id


class Run:
    def __init__(self, service: Service, settings: Settings, share_prompt: bool = True, client_id: str = ""):
        self.service, self.settings, self.share_prompt, self.client_id = service, settings, share_prompt, client_id
        self.columns = {m: Column(m) for m in MODES}
        # "compare proposers": the speculative request again with the other proposer, shown beside the first
        self.rival: Column | None = None
        self.trees = {m: BranchTree.of(c) for m, c in self.columns.items()}  # each column's root + its branches
        # the run's columns and branches share one replica's cache: the router sends them where the key went first
        self.route_key = f"run-{new_request_id()}"
        self.started_at = time.time()
        self.kv: list[KVSnapshot] = []
        self.kv_peak: KVSnapshot | None = None  # the snapshot with the most blocks held by this run
        self.steps: dict[str, dict[int, StepRecord]] = {}  # per replica: step number -> a step that ran this run
        self.roofs: dict[str, dict] = {}  # per replica: its measured roofs (heartbeat)
        self._step_cursors: dict[str, str] = {}  # per replica: the last step-record stream id read
        self.message: str | None = None  # for the whole run (engine down, ...)
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()  # cuts the pause between frames short (_touch): the run's end, a first token
        self._shown_tokens = 0  # how many columns had a token in the last frame
        self._stop_at: float | None = None
        self._tasks: list[asyncio.Task] = []
        self._prefilled = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pace = 0.0  # the caller's pause before the next update (from the last one's size), unless _urgent
        self.shared: str | None = None  # a saved run re-opened (web/share.py): its link id or file name; read-only
        self.answered = asyncio.Event()  # web/handlers.py has sent the run's last frame (its data)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self._roots())

    def _touch(self) -> None:
        """Something visible changed: wake the frame loop, and cut its pause short for what should be drawn at once."""
        self._changed.set()
        if self._urgent():
            self._wake.set()

    def _urgent(self) -> bool:
        """Whether the next frame should go out without waiting out its budget: every column has ended (the last
        tokens and their final state), or a column's first token is in and no frame has shown it yet (with the
        prompt shared, the other columns' first tokens come a step after greedy's: they waited out the rest of
        min_interval, 45-57 ms in three traced browser runs on a 2-core AVX2 EPYC)."""
        return self.finished or self._with_token() > self._shown_tokens

    def _with_token(self) -> int:
        return sum(1 for c in self._roots() if c.first_token_at)

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds` before the next frame, unless something urgent comes first (or is already here)."""
        if self._urgent():
            return
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _roots(self) -> list[Column]:
        """The columns Run sends: one per mode, and the rival proposer's."""
        return [*self.columns.values(), *([self.rival] if self.rival is not None else [])]

    def all_columns(self) -> list[Column]:
        """The roots and every branch."""
        return [c for t in self.trees.values() for c in t.columns()] + ([self.rival] if self.rival else [])

    def owners(self) -> dict[str, str]:
        """request id -> its KV-map label: the mode, with the branch number for branches."""
        owners = {b.column.request_id: m if b.parent is None else f"{m} ⑂{b.id}"
                  for m, t in self.trees.items() for b in t.branches if b.column.request is not None}
        if self.rival is not None and self.rival.request is not None:
            owners[self.rival.request_id] = f"speculative · {self.rival.request.params.proposer}"
        return owners

    def stop(self) -> None:
        """Cancel every request still out (called on the run's event loop, e.g. by the Stop button)."""
        branches = [c for c in self.all_columns() if c not in self._roots() and not c.finished]
        if branches:
            self._tasks.append(asyncio.create_task(self._cancel_quietly(branches)))
        if self._stop_at is None:
            self._stop_at = time.monotonic()
            self._tasks.append(asyncio.create_task(self._cancel_quietly()))
            self._touch()

    async def _cancel_quietly(self, columns: list[Column] | None = None) -> None:
        client = self.service.client()
        for col in columns if columns is not None else self._roots():
            if col.request is not None and (columns is not None or not col.finished):
                with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(client.cancel(col.request_id), 2.0)
        self._touch()

    # ---- the run
    async def updates(self, min_interval: float = 0.12) -> AsyncIterator[None]:
        """Yield whenever something visible changed (at most every `min_interval` s) until every column ends."""
        self.loop = asyncio.get_running_loop()
        self._prepare()
        greedy_first = self.share_prompt and self.columns["greedy"].request is not None
        if not greedy_first:
            self._prefilled.set()
        for col in self._roots():
            if col.request is not None:
                col.status = "queued" if (col.mode == "greedy" or not greedy_first) else "waiting"
                col.touch()
                self._tasks.append(asyncio.create_task(self._stream(col)))
        self._tasks.append(asyncio.create_task(self._watch()))
        try:
            yield
            while not self.finished:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 0.5)
                self._changed.clear()
                if self._stop_at is not None and time.monotonic() - self._stop_at > STOP_GRACE_S:
                    for col in self._roots():
                        if not col.finished:
                            col.fail("stopped before the replica confirmed", "cancelled", "cancelled")
                self._shown_tokens = self._with_token()  # what the frame drawn now holds
                yield
                # the next frame waits out the budget (min_interval, or the last frame's size: pace), but not for
                # a column's first token or the run's end (without that, the end came up to a pace late: ~0.4 s by
                # 64 tokens in four columns)
                await self._pause(max(min_interval, self.pace))
            self.kv = await self.service.kv()
            await self.take_steps()
            yield
        finally:
            for task in self._tasks:
                task.cancel()
            if not self.finished:  # the browser went away mid-run: stop the generations
                await asyncio.shield(self._cancel_quietly())

    def _prepare(self) -> None:
        for mode, col in self.columns.items():
            try:
                col.request = build_request(mode, self.settings, self.client_id)
            except InputError as e:
                col.fail(str(e), "invalid_request", "invalid")
        if self.settings.compare_proposers and self.columns["speculative"].request is not None:
            other = replace(self.settings, proposer=other_proposer(self.settings.proposer))
            self.rival = Column("speculative")
            self.rival.request = build_request("speculative", other, self.client_id)  # valid: only the proposer differs

    async def _stream(self, col: Column) -> None:
        client = self.service.client()
        if col.status == "waiting":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._prefilled.wait(), PREFILL_WAIT_S)
            if self._stop_at is not None:
                col.fail("stopped before it was sent", "cancelled", "cancelled")
                self._touch()
                return
            col.request = col.request.model_copy(update={"created_at": time.time()})
            col.status = "queued"
        col.submitted_at = col.request.created_at
        try:
            try:
                sub = await asyncio.wait_for(client.submit(col.request, self.route_key), 5.0)
            except QueueFull as e:
                col.fail(str(e), e.code)  # queue_full, or too_many_requests for this browser session
                return
            except (TimeoutError, RedisError, OSError) as e:
                col.fail(f"Redis unreachable: {e or type(e).__name__}", "unavailable")
                return
            col.entry_id, col.stream = sub.entry_id, sub.stream
            col.touch()
            self._touch()
            async for ev in client.stream(sub, timeout=600):
                col.feed(ev)
                if col.mode == "greedy":
                    self._prefilled.set()  # its prompt blocks are computed and in the prefix cache now
                self._touch()
        except Exception as e:  # never leave a column spinning
            log.exception("streaming %s", col.mode)
            col.fail(f"the playground lost this stream: {type(e).__name__}: {e}", "unavailable")
        finally:
            if col.mode == "greedy":
                self._prefilled.set()
            self._touch()

    async def _watch(self) -> None:
        """Queue positions, KV snapshots, and the service's pulse while anything is out."""
        state = {"redis_lost": None, "replicas_lost": None, "last_health": 0.0}
        while not self.finished:
            try:
                await self._watch_once(state)
            except Exception:  # a bad snapshot must not stop the watchdog
                log.exception("watching the service")
            self._touch()
            await asyncio.sleep(0.25)

    async def _watch_once(self, state: dict) -> None:
        client, keys = self.service.client(), self.service.keys
        now = time.monotonic()
        if now - state["last_health"] >= 1.0:
            state["last_health"] = now
            ok, live = await self.service.health()
            self.take_replicas(live)
            state["redis_lost"] = None if ok else (state["redis_lost"] or now)
            state["replicas_lost"] = None if (live or not ok) else (state["replicas_lost"] or now)
            if state["redis_lost"] and now - state["redis_lost"] > self.service.redis_gone_s:
                self._abandon("Redis became unreachable during the run; the results are unknown.", "unavailable")
            elif state["replicas_lost"] and now - state["replicas_lost"] > self.service.replica_gone_s:
                out = [c for c in self._roots() if not c.finished]
                self._abandon("The engine went down: no replica has sent a heartbeat for "
                              f"{self.service.replica_gone_s:.0f}s. Start one (decodelab engine) and run again.",
                              "unavailable")
                await self._cancel_quietly(out)  # so that a replica starting later does not run them
        if state["redis_lost"]:
            return
        for col in self._roots():
            if col.status == "queued" and col.entry_id:
                with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
                    pos = await asyncio.wait_for(
                        monitor.queue_position(client.redis, keys, col.entry_id, col.stream), 2)
                    if pos != col.queue_position:
                        col.queue_position = pos
                        col.touch()
        self.take_kv(await self.service.kv())
        await self.take_steps()

    def take_kv(self, snaps: list[KVSnapshot]) -> None:
        self.kv = snaps
        ours = {c.request_id for c in self.all_columns() if c.request is not None}

        def held(s: KVSnapshot) -> int:
            return len({b for q in s.seqs if q.request_id in ours for b in q.blocks})

        for s in snaps:
            if held(s) and (self.kv_peak is None or held(s) >= held(self.kv_peak)):
                self.kv_peak = s

    def take_replicas(self, live: dict[str, dict]) -> None:
        """The replicas' heartbeats: their roofs, for the engine-steps panel."""
        self.roofs.update((name, r["roofs"]) for name, r in live.items() if isinstance(r.get("roofs"), dict))

    async def take_steps(self) -> None:
        """Read on in the step stream of each replica seen (KV snapshots, heartbeats); keep the steps whose batch
        held one of this run's requests, once each (by step number)."""
        ours = {c.request_id for c in self.all_columns() if c.request is not None}
        for name in sorted({s.replica for s in self.kv} | set(self.roofs)):
            since = self._step_cursors.get(name) or monitor.stream_id_at(self.started_at - STEPS_LOOKBACK_S)
            for _ in range(STEP_PAGES):
                records, since = await self.service.steps(name, since)
                for s in records:
                    if ours.intersection(s.request_ids):
                        self.steps.setdefault(name, {})[s.step] = s
                if len(records) < STEP_PAGE:
                    break
            self._step_cursors[name] = since

    def step_lists(self) -> dict[str, list[StepRecord]]:
        """Per replica, this run's steps, oldest first."""
        return {name: [by_step[k] for k in sorted(by_step)] for name, by_step in self.steps.items()}

    def _abandon(self, message: str, code: str) -> None:
        self.message = message
        for col in self._roots():
            if not col.finished:
                col.fail(message, code)

    # ---- branches (web/branches.py): forked from a token after or during the run, each streamed by its caller
    def fork(self, mode: str, parent: int, pos: int, picked: Token) -> Branch:
        """A branch of `mode`'s column from `parent`'s tokens[:pos] + `picked`, its request ready to send;
        BranchError when that is not possible."""
        tree = self.trees[mode]
        root = tree.root.column.request
        if root is None:
            raise BranchError(f"branch: the {mode} column sent no request")
        branch = tree.fork(parent, pos, picked, Column(mode))
        params = root.params.model_copy(update={"max_tokens": max(1, root.params.max_tokens - len(branch.inherited))})
        col = branch.column
        col.request = root.model_copy(update={"request_id": new_request_id(), "created_at": time.time(),
                                              "continuation": continuation(branch.inherited), "params": params})
        col.status = "queued"
        col.touch()
        return branch

    async def follow(self, branch: Branch, min_interval: float = 0.12) -> AsyncIterator[None]:
        """Send the branch's request and yield on every change until it ends; cancels it if the caller goes."""
        col = branch.column
        self.loop = self.loop or asyncio.get_running_loop()
        task = asyncio.create_task(self._stream(col))
        seen = -1
        try:
            while True:
                if col.version != seen:
                    seen = col.version
                    yield
                    continue  # the column may have changed, or ended, while the caller drew: draw that first
                if col.finished:
                    return
                if task.done():  # _stream always ends its column; this is the belt to its braces
                    col.fail("the stream ended without a result", "unavailable")
                    continue
                await asyncio.sleep(min_interval)
        finally:
            if not task.done():
                task.cancel()
            if not col.finished:
                await asyncio.shield(self._cancel_quietly([col]))
                col.fail("stopped", "cancelled", "cancelled")
