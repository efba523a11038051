"""Greedy token ids equal HF generate(do_sample=False) in fp32 under every scheduling path."""
import pytest

from engine_service import LLM, SamplingParams
from tests.helpers import GREEDY, random_prompt
from tests.hf_oracle import assert_greedy_matches, hf_greedy


def check(model_dir, prompts, outputs, max_tokens) -> None:
    for prompt, out in zip(prompts, outputs):
        theirs = hf_greedy(model_dir, prompt, max_tokens)
        assert_greedy_matches(model_dir, prompt, out.outputs[0].token_ids, theirs)


@pytest.fixture(params=["llama", "qwen2"])
def tiny_dir(request, tiny_llama_dir, tiny_qwen2_dir):
    return tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir


@pytest.fixture(params=["avx2", "torch"])
def cpu_kernels(request, monkeypatch):
    """Both CPU paths for attention, the layer ops and the sampler's log-prob statistics: our AVX2 kernels
    (where they build) and PyTorch's."""
    from decodelab_kernels import cpu_decode_attention, cpu_layer_ops, cpu_logits

    if request.param == "torch":
        monkeypatch.setattr(cpu_decode_attention, "enabled", lambda: False)
        monkeypatch.setattr(cpu_layer_ops, "enabled", lambda: False)
        monkeypatch.setattr(cpu_logits, "enabled", lambda: False)
    elif cpu_layer_ops.unavailable() or cpu_decode_attention.unavailable():
        pytest.skip("the AVX2 kernels do not build here")
    return request.param


def test_batch_of_ragged_prompts_matches_hf(tiny_dir, cpu_kernels):
    prompts = [random_prompt(n, seed=i) for i, n in enumerate([1, 5, 16, 17, 40, 70])]
    llm = LLM(str(tiny_dir), num_kv_blocks=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, **GREEDY))
    check(tiny_dir, prompts, outs, 24)


def test_requests_added_mid_flight_match_hf(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256)
    engine, prompts = llm.engine, [random_prompt(n, seed=10 + i) for i, n in enumerate([9, 23, 3, 33, 18])]
    params = SamplingParams(max_tokens=20, **GREEDY)
    finals, batch_sizes = {}, []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        for _ in range(3):  # the next request arrives while the earlier ones decode
            for out in engine.step():
                finals[out.request_id] = out
            batch_sizes.append(len(engine.scheduler.running))
    while engine.has_unfinished():
        for out in engine.step():
            finals[out.request_id] = out
    assert max(batch_sizes) > 1
    check(tiny_llama_dir, prompts, [finals[str(i)] for i in range(len(prompts))], 20)


def test_prefix_cache_hit_skips_prefill_and_matches_hf(tiny_qwen2_dir):
    llm = LLM(str(tiny_qwen2_dir), num_kv_blocks=256, block_size=8)
    shared = random_prompt(40, seed=2)
    prompts = [shared + [5, 6, 7], shared + [9, 10]]
    params = SamplingParams(max_tokens=12, **GREEDY)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params)[0]
    second = llm.generate({"prompt_token_ids": prompts[1]}, params)[0]
    assert first.metrics.cached_prompt_tokens == 0
    assert second.metrics.cached_prompt_tokens == 40  # five full blocks of 8
    assert llm.engine.block_manager.stats.prefix_hits == 40
    check(tiny_qwen2_dir, prompts, [first, second], 12)


def test_fully_cached_prompt_recomputes_its_last_block(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8)
    prompt = random_prompt(32, seed=3)
    params = SamplingParams(max_tokens=8, **GREEDY)
    a = llm.generate({"prompt_token_ids": prompt}, params)[0]
    b = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert b.metrics.cached_prompt_tokens == 24
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    check(tiny_llama_dir, [prompt], [b], 8)


def test_chunked_prefill_mixed_with_decodes_matches_hf(tiny_dir):
    budget = 16
    engine = LLM(str(tiny_dir), num_kv_blocks=256, max_num_batched_tokens=budget).engine
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate([3, 90, 7, 51])]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=16, **GREEDY))
    long = engine.requests["1"].seqs[0]  # 90 tokens: more than one step's budget
    chunks, decoded_beside, finals = [], 0, {}
    while long.num_computed_tokens < 90:  # until its prefill is done (that step samples its first token)
        before = long.num_computed_tokens
        outs = engine.step()
        finals.update({o.request_id: o for o in outs if o.finished})
        if (chunk := long.num_computed_tokens - before):
            chunks.append(chunk)
            decoded_beside += any(o.request_id != "1" and o.outputs[0].token_ids for o in outs)
    # prefilled in several steps, none over the budget, while the short prompts already decoded
    assert len(chunks) >= -(-90 // budget) and max(chunks) <= budget and sum(chunks) == 90, chunks
    assert decoded_beside > 1
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    check(tiny_dir, prompts, [finals[str(i)] for i in range(len(prompts))], 16)


def test_forced_preemption_gives_the_same_tokens(tiny_llama_dir):
    prompts = [random_prompt(n, seed=50 + i) for i, n in enumerate([20, 33, 12, 45] * 2)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    roomy = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=8).generate(
        [{"prompt_token_ids": p} for p in prompts], params)
    tight = LLM(str(tiny_llama_dir), num_kv_blocks=24, block_size=8)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert tight.engine.block_manager.num_free_blocks == 24
    check(tiny_llama_dir, prompts, outs, 40)


@pytest.mark.slow
def test_smollm2_batch_matches_hf(smollm2_dir):
    llm = LLM(str(smollm2_dir), num_kv_blocks=256)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
    outs = llm.generate(texts, SamplingParams(max_tokens=16, **GREEDY))
    assert outs[0].outputs[0].text.startswith(" Paris")
    check(smollm2_dir, [o.prompt_token_ids for o in outs], outs, 16)


def test_a_request_waiting_for_blocks_counts_its_prefix_lookup_once(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=8, block_size=8)
    engine = llm.engine
    engine.add_request("big", random_prompt(40, seed=6), SamplingParams(max_tokens=16, **GREEDY))
    engine.step()
    engine.add_request("late", random_prompt(20, seed=7), SamplingParams(max_tokens=4, **GREEDY))
    waited = 0
    while engine.has_unfinished():
        engine.step()
        waited += any(s.request.request_id == "late" for s in engine.scheduler.waiting)
    assert waited > 1  # it was looked up and turned away several times
    assert engine.block_manager.stats.prefix_queries == 40 + 20
