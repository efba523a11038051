"""Parallel sampling (n > 1): children fork the prompt's blocks and diverge with copy-on-write."""
from collections import Counter

import pytest

from engine_service import LLM, SamplingParams
from tests.helpers import random_prompt


def sample_params(n: int, seed: int | None = 7, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, ignore_eos=True, max_tokens=max_tokens)


def ids(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=16)


def test_seeded_parallel_samples_are_reproducible_whatever_else_is_in_the_batch(llm):
    prompt = random_prompt(20, seed=1)
    alone = llm.generate({"prompt_token_ids": prompt}, sample_params(4))[0]
    crowd = [{"prompt_token_ids": random_prompt(10 + i, seed=50 + i)} for i in range(3)]
    mixed = llm.generate([*crowd, {"prompt_token_ids": prompt}], [sample_params(2, seed=None)] * 3 + [sample_params(4)])
    assert ids(mixed[3]) == ids(alone)
    assert len({tuple(t) for t in ids(alone)}) > 1  # the children really diverge


def test_child_i_samples_like_a_single_request_seeded_with_seed_plus_i(llm):
    prompt = random_prompt(20, seed=2)
    parallel = ids(llm.generate({"prompt_token_ids": prompt}, sample_params(3, seed=40))[0])
    singles = [ids(llm.generate({"prompt_token_ids": prompt}, sample_params(1, seed=40 + i))[0])[0] for i in range(3)]
    assert parallel == singles


@pytest.mark.parametrize("prompt_len,copies", [(20, 3), (32, 0)])
def test_children_copy_the_shared_last_block_only_when_it_is_partial(tiny_llama_dir, prompt_len, copies):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    llm.generate({"prompt_token_ids": random_prompt(prompt_len, seed=3)}, sample_params(4))
    # four holders of a partial last block: three copy it on their first write, the last writes in place
    assert llm.engine.block_manager.stats.cow_copies == copies


def test_children_share_the_prompt_blocks_while_decoding(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=16)
    engine = llm.engine
    engine.add_request("r", random_prompt(70, seed=4), sample_params(4, max_tokens=8))
    engine.step()  # prefill, fork, first tokens
    engine.step()  # every child writes its second token: copy-on-write happened
    held = Counter(b for s in engine.scheduler.running for b in s.block_table)
    assert [held[b] for b in engine.scheduler.running[0].block_table[:4]] == [4, 4, 4, 4]  # the full prompt blocks
    assert engine.block_manager.summary()["blocks_used"] == 4 + 4  # shared prompt blocks + one tail each
    while engine.has_unfinished():
        engine.step()


def test_finished_parallel_request_frees_every_block(llm):
    engine = llm.engine
    llm.generate({"prompt_token_ids": random_prompt(45, seed=5)}, sample_params(5, max_tokens=20))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running


def test_aborting_a_parallel_request_frees_its_children_at_once(llm):
    engine = llm.engine
    engine.add_request("a", random_prompt(30, seed=6), sample_params(3, max_tokens=50))
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 3
    engine.abort("a")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished()


def test_cli_sample_mode_prints_n_outputs(tiny_llama_dir, capsys):
    from engine_service.cli import main

    rc = main(["generate", "--model", str(tiny_llama_dir), "--num-kv-blocks", "64", "--prompt", "Once upon",
               "--mode", "sample", "--n", "3", "--seed", "1", "--max-tokens", "5", "--ignore-eos"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and [line[:3] for line in lines] == ["[0]", "[1]", "[2]"]
