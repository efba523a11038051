"""Speculative decoding through a real replica (`decodelab engine --draft-model`): the draft checks stream with
the tokens they produced, the done event carries them and the by-position counters, the heartbeat names the
draft model."""
import pytest
import redis.asyncio as aioredis

from shared import monitor
from shared.client import EngineClient
from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions, TokenEvent
from tests.engine.test_spec_decode import save_draft

from .conftest import run


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir, tmp_path_factory):
    return save_draft(tiny_llama_dir, tmp_path_factory.mktemp("events_draft"), noise=0.05)


def test_token_events_carry_draft_checks_aligned_with_their_tokens(spawn_replica, redis_server, keys, draft_dir):
    spawn_replica("spec", "--draft-model", str(draft_dir)).wait_ready()
    params = SamplingOptions(mode="speculative", proposer="draft", num_speculative_tokens=3, temperature=0.8,
                             seed=5, max_tokens=40, ignore_eos=True)

    async def main():
        r = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        client = EngineClient(r, keys)
        sub = await client.submit(GenerationRequest(prompt="Readability counts. Simple is", params=params))
        events = [ev async for ev in client.stream(sub, 60)]
        live = await monitor.replicas(r, keys)
        await r.aclose()
        return events, live

    events, live = run(main())
    assert live["spec"]["draft_model"] == str(draft_dir)
    tokens = [ev for ev in events if isinstance(ev, TokenEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "length"
    streamed = []
    for ev in tokens:
        assert len(ev.drafts) == len(ev.token_ids) == len(ev.spec)
        for token_id, mark, check in zip(ev.token_ids, ev.spec, ev.drafts):
            assert (check is None) == (mark in ("target", "bonus"))
            if mark == "accepted":
                assert check.accepted and check.draft_token_id == token_id and check.residual_token_id is None
            elif mark == "resampled":
                assert not check.accepted and check.residual_token_id == token_id != check.draft_token_id
                assert check.residual_token and check.residual_top
            streamed.append(check)
    final = done.outputs[0]
    assert final.drafts == streamed and len(final.drafts) == len(final.token_ids) == 40
    checks = [c for c in streamed if c is not None]
    assert {c.accepted for c in checks} == {True, False}  # both paths ran
    spec = done.metrics.spec
    assert (sum(spec["proposed_by_position"]), sum(spec["accepted_by_position"])) == (spec["proposed"],
                                                                                      spec["accepted"])
    assert spec["accepted_by_position"] == [sum(c.accepted and c.position == i for c in checks) for i in range(3)]
