"""Helpers shared by the test suites: greedy options, random prompts, bounded waits, the repository root."""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Greedy to the full max_tokens (no early EOS), as keyword arguments: SamplingParams(max_tokens=8, **GREEDY),
# SamplingOptions(**GREEDY) and OpenAI request bodies all take them.
GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    """`length` random token ids in [3, vocab): never 0-2, the pad/bos/eos ids of tests/tiny_models.py."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def wait_until(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll `predicate` until it returns something truthy (returned); AssertionError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (value := predicate()):
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run(coro, timeout: float = 60.0):
    """Run a coroutine to completion with a hard timeout (every wait in these tests is bounded)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Completions:
    """Every event published under `keys` while it runs (asyncio): DoneEvents counted per request id (a request
    completed twice shows as 2); `seen` is set at the first event of any kind."""

    def __init__(self, redis, keys):
        self.redis, self.keys = redis, keys
        self.dones: Counter = Counter()
        self.seen = asyncio.Event()

    async def __aenter__(self) -> Completions:
        self._pubsub = self.redis.pubsub()
        await self._pubsub.psubscribe(self.keys.events("*"))
        self._task = asyncio.create_task(self._watch())
        return self

    async def _watch(self) -> None:
        from shared.protocol import DoneEvent, decode_event

        while True:
            msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            await asyncio.sleep(0)  # a busy channel would otherwise starve the other tasks
            if msg:
                ev = decode_event(msg["data"])
                self.dones[ev.request_id] += isinstance(ev, DoneEvent)
                self.seen.set()

    async def __aexit__(self, *exc) -> None:
        await asyncio.sleep(0.5)  # a late duplicate would show up now
        self._task.cancel()
        await self._pubsub.aclose()


def cpu_int8_build(name: str):
    """pytest.param of one decodelab_kernels/cpu_int8 build, skipped where it does not run (the reason names what
    is missing)"""
    import pytest

    from decodelab_kernels import cpu_int8

    why = cpu_int8.unavailable(name)
    return pytest.param(name, marks=pytest.mark.skipif(why is not None, reason=f"no {name} int8 kernel: {why}"))
