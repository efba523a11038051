"""Preemption always ends: a preempted request comes back within what admission promised, the engine
never spins on an empty step, and any mix of modes on a tiny pool finishes and frees every block."""
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_service import LLM, SamplingParams
from engine_service.engine.proposers import DraftSeq
from tests.helpers import random_prompt

MAX_STEPS = 400  # far above what any request here needs: reaching it means the engine is stuck


def stuck(engine) -> str:
    s = engine.scheduler
    return f"stuck: {len(s.waiting)} waiting, {len(s.running)} running, {s.bm.num_free_blocks} blocks free"


def run_to_end(engine) -> dict:
    finals, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        assert steps < MAX_STEPS, stuck(engine)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def assert_pool_is_free(engine) -> None:
    """Every block is back: free, or only a prefix-cache entry that nothing holds."""
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


GREEDY_40 = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40)
BEAM_4 = SamplingParams(mode="beam", beam_width=4, n=4, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def unpreempted_beams(tiny_llama_dir):
    roomy = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8)
    return [c.token_ids for c in roomy.generate({"prompt_token_ids": random_prompt(32, seed=1)}, BEAM_4)[0].outputs]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_preempted_beam_group_comes_back_within_the_blocks_admission_promised(tiny_llama_dir, unpreempted_beams,
                                                                                prefix_caching):
    # the group fits (4 shared prompt blocks + 4 tails = 8 of 9) and is preempted when the greedy request grows;
    # recomputing each beam on its own would need 4 x 5 blocks
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=9, block_size=8, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    engine.add_request("greedy", random_prompt(7, seed=0), GREEDY_40)
    engine.add_request("beam", random_prompt(32, seed=1), BEAM_4)
    if prefix_caching:  # the cached prompt blocks get evicted while the group waits
        engine.add_request("evictor", random_prompt(16, seed=2), SamplingParams(temperature=0, max_tokens=1))
    finals = run_to_end(engine)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.stats.evictions > 0 or not prefix_caching
    assert [c.token_ids for c in finals["beam"].outputs] == unpreempted_beams
    assert_pool_is_free(engine)


def test_a_step_that_can_schedule_nothing_raises_instead_of_spinning(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), num_kv_blocks=4, block_size=8).engine
    engine.add_request("r", random_prompt(8, seed=3), SamplingParams(temperature=0, max_tokens=4))
    engine.block_manager.allocate(DraftSeq(list(range(32))), 32)  # a leak: every block held by nobody we know
    with pytest.raises(AssertionError, match="scheduled nothing"):
        engine.step()


# tiny pools: preemption, chunked prefill and refused admissions are the common case, not the corner
POOLS = [dict(num_kv_blocks=10, block_size=4),
         dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=16),
         dict(num_kv_blocks=24, block_size=2, enable_prefix_caching=False, max_num_seqs=4)]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return [LLM(str(tiny_llama_dir), **pool).engine for pool in POOLS]


PROMPT_LENGTHS, REPEATS = st.integers(1, 16), st.integers(1, 2)


def request(params, lengths=PROMPT_LENGTHS, repeats=REPEATS):
    """(prompt, params, arrival step); repeated prompts give the n-gram proposer matches."""
    prompt = st.builds(lambda n, seed, r: random_prompt(n, seed=seed) * r, lengths, st.integers(0, 4), repeats)
    return st.tuples(prompt, params, st.integers(0, 8))


REQUEST_IDS = itertools.count()
tokens, eos = st.integers(1, 24), st.booleans()
REQUEST = st.one_of(
    request(st.builds(lambda m, e: SamplingParams(temperature=0, max_tokens=m, ignore_eos=e), tokens, eos)),
    request(st.builds(lambda n, m, e, s: SamplingParams(n=n, temperature=0.8, top_k=20, seed=s, max_tokens=m,
                                                        ignore_eos=e),
                      st.integers(1, 4), tokens, eos, st.one_of(st.none(), st.integers(0, 99)))),
    request(st.builds(lambda k, t, m, e: SamplingParams(mode="speculative", proposer="ngram", num_speculative_tokens=k,
                                                        temperature=t, seed=7, max_tokens=m, ignore_eos=e),
                      st.integers(1, 4), st.sampled_from([0.0, 0.8]), tokens, eos)),
    # beam groups with long prompts and short outputs: the shape that admission lets in at the pool's edge
    request(st.builds(lambda w, m, e: SamplingParams(mode="beam", beam_width=w, n=w, max_tokens=m, ignore_eos=e),
                      st.integers(2, 4), st.integers(1, 8), eos), lengths=st.integers(8, 30), repeats=st.just(1)),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool=st.integers(0, len(POOLS) - 1), requests=st.lists(REQUEST, min_size=2, max_size=4))
def test_any_mix_of_modes_on_a_tiny_pool_finishes_and_frees_every_block(engines, pool, requests):
    engine = engines[pool]
    arrivals = sorted(enumerate(requests), key=lambda r: r[1][2])
    admitted, finals, steps = {}, {}, 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0][1][2] <= steps:
            i, (prompt, params, _) = arrivals.pop(0)
            rid = str(next(REQUEST_IDS))
            try:
                engine.add_request(rid, prompt, params)
                admitted[rid] = params
            except ValueError:  # more than this pool can ever hold: refused up front, never stuck
                pass
        steps += 1
        assert steps < MAX_STEPS, stuck(engine)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == set(admitted)
    for rid, params in admitted.items():
        assert len(finals[rid].outputs) == params.n
        assert all(0 < len(o.token_ids) <= params.max_tokens for o in finals[rid].outputs)
    assert_pool_is_free(engine)
    assert not engine.requests
