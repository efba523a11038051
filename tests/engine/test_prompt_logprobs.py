"""SamplingParams(prompt_logprobs=N), vLLM's shape: RequestOutput.prompt_logprobs is None for the first prompt
token, then per prompt token {id: log-prob} of the top N plus the token itself, computed during prefill; checked
against Hugging Face's log-softmax of the prompt logits. Chunked prefill, preemption and the prefix cache must
not lose or repeat a position."""
import os

import pytest
import torch

from engine_service import LLM, SamplingParams
from tests.helpers import GREEDY, random_prompt
from tests.hf_oracle import hf_greedy, hf_model

THREADS = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
PROMPT = random_prompt(30, seed=11)


@torch.inference_mode()
def hf_prompt_logprobs(model_dir, prompt: list[int], n: int) -> list[dict[int, float] | None]:
    lp = hf_model(str(model_dir))(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    out = [None]
    for pos in range(1, len(prompt)):
        row = lp[pos - 1]
        top = dict(zip(*(x.tolist() for x in reversed(row.topk(n)))) if n else {})
        out.append({**top, prompt[pos]: float(row[prompt[pos]])})
    return out


def assert_prompt_logprobs_match(ours, theirs) -> None:
    assert len(ours) == len(theirs) and ours[0] is None
    for pos, (a, b) in enumerate(zip(ours[1:], theirs[1:]), start=1):
        assert a.keys() == b.keys(), f"position {pos}"
        assert [a[t] for t in b] == pytest.approx(list(b.values()), abs=1e-4), f"position {pos}"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8, num_threads=THREADS)


def test_prompt_logprobs_are_hfs_log_softmax_top_n_plus_the_prompt_token(llm, tiny_llama_dir):
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=4, prompt_logprobs=3, **GREEDY))[0]
    assert_prompt_logprobs_match(out.prompt_logprobs, hf_prompt_logprobs(tiny_llama_dir, PROMPT, 3))
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, PROMPT, 4)  # generation goes on as usual


def test_zero_gives_each_prompt_token_alone(llm, tiny_llama_dir):
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))[0]
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])
    assert_prompt_logprobs_match(out.prompt_logprobs, hf_prompt_logprobs(tiny_llama_dir, PROMPT, 0))


def test_without_the_parameter_there_are_none(llm):
    assert llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_a_chunked_prefill_scores_every_position_once(tiny_llama_dir):
    chunked = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, max_num_batched_tokens=7,
                  num_threads=THREADS)
    out = chunked.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY))
    assert_prompt_logprobs_match(out[0].prompt_logprobs, hf_prompt_logprobs(tiny_llama_dir, PROMPT, 2))


def test_a_request_with_prompt_logprobs_skips_prefix_cache_hits_on_its_prompt(llm, tiny_llama_dir):
    plain = SamplingParams(max_tokens=1, **GREEDY)
    llm.generate({"prompt_token_ids": PROMPT}, plain)  # its blocks are now in the prefix cache
    scored = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY))[0]
    assert scored.metrics.cached_prompt_tokens == 0
    assert_prompt_logprobs_match(scored.prompt_logprobs, hf_prompt_logprobs(tiny_llama_dir, PROMPT, 1))
    assert llm.generate({"prompt_token_ids": PROMPT}, plain)[0].metrics.cached_prompt_tokens > 0  # others still hit


def test_a_step_mixing_drafts_decodes_and_prompt_scoring_gets_every_row_right(llm, tiny_llama_dir):
    engine = llm.engine
    every_token = list(range(3, 512))  # whatever comes next, the n-gram proposer finds it: drafts at once
    engine.add_request("spec", every_token, SamplingParams(max_tokens=12, mode="speculative", temperature=0,
                                                          ignore_eos=True))
    engine.add_request("plain", random_prompt(9, seed=3), SamplingParams(max_tokens=12, **GREEDY))
    finals = {out.request_id: out for out in engine.step() if out.finished}  # both prefilled: drafts come next
    engine.add_request("scored", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY))
    while engine.has_unfinished():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    assert engine.spec.totals.proposed > 0
    assert finals["spec"].outputs[0].token_ids == hf_greedy(tiny_llama_dir, every_token, 12)
    assert finals["plain"].outputs[0].token_ids == hf_greedy(tiny_llama_dir, random_prompt(9, seed=3), 12)
    assert_prompt_logprobs_match(finals["scored"].prompt_logprobs, hf_prompt_logprobs(tiny_llama_dir, PROMPT, 2))
    assert finals["scored"].outputs[0].token_ids == hf_greedy(tiny_llama_dir, PROMPT, 3)


def test_a_request_preempted_in_the_middle_of_its_prefill_keeps_its_scored_positions(tiny_llama_dir):
    # 5 blocks of 8: the growing greedy request takes the blocks the chunked prefill of the scored one holds,
    # and the scored one (the newer) is preempted, then recomputes from its first token
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=5, block_size=8, max_num_batched_tokens=4, num_threads=THREADS)
    engine = llm.engine
    engine.add_request("grow", random_prompt(15, seed=0), SamplingParams(max_tokens=20, **GREEDY))
    engine.add_request("scored", PROMPT[:24], SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY))
    finals, preempted_partway = {}, False
    while engine.has_unfinished():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
        waiting = [s for s in engine.scheduler.waiting if s.request.request_id == "scored"]
        scored = engine.requests.get("scored")
        preempted_partway |= bool(waiting and scored and 1 < len(scored.prompt_logprobs) < 24)
    assert preempted_partway
    assert_prompt_logprobs_match(finals["scored"].prompt_logprobs, hf_prompt_logprobs(tiny_llama_dir, PROMPT[:24], 1))


@pytest.mark.parametrize("value", [-1, 21, 1.5])
def test_out_of_range_values_raise_naming_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
