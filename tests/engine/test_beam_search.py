"""Beam search in the engine: HF generate(num_beams=W, do_sample=False) semantics on forked sequences."""
import random
from collections import Counter

import pytest
import torch
from transformers import AutoConfig, GenerationConfig

from engine_service import LLM, SamplingParams
from tests.hf_oracle import hf_model


def random_prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


@torch.inference_mode()
def hf_beams(model_dir, prompt: list[int], width: int, n: int, max_tokens: int, length_penalty=1.0,
             early_stopping=False, eos=None, **kwargs) -> list[tuple[list[int], float]]:
    """HF's n best beams, best first: (generated ids, sequences_score)."""
    out = hf_model(str(model_dir)).generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
        num_beams=width, num_return_sequences=n, max_new_tokens=max_tokens, length_penalty=length_penalty,
        early_stopping=early_stopping, eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True,
        output_scores=True, **kwargs)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt):len(prompt) + lengths[i]].tolist(), float(out.sequences_scores[i]))
            for i in range(n)]


def hf_default_eos(model_dir) -> list[int]:
    """The stop ids a plain HF generate() uses (generation_config.json, else the model config's), never the
    engine's own idea of them: the oracle must not inherit a mistake of the engine under test."""
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir)).eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def beam_params(width, n, max_tokens, length_penalty=1.0, early_stopping=False, eos=None, **kwargs):
    return SamplingParams(mode="beam", beam_width=width, n=n, max_tokens=max_tokens, length_penalty=length_penalty,
                          early_stopping=early_stopping, ignore_eos=True, stop_token_ids=eos or [], **kwargs)


def assert_beams_match(ours, theirs) -> None:
    assert [o.token_ids for o in ours.outputs] == [ids for ids, _ in theirs]
    assert [o.score for o in ours.outputs] == pytest.approx([s for _, s in theirs], rel=1e-4, abs=1e-4)


def assert_refcounts_match_tables(engine) -> None:
    """No leaked or stale block: every used block is held exactly by the tables that list it."""
    held = Counter(b for s in engine.scheduler.running for b in s.block_table)
    used = {b.block_id: b.ref_count for b in engine.block_manager.blocks if b.ref_count > 0}
    assert used == dict(held)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=512)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_dir):
    return LLM(str(smollm2_dir), num_kv_blocks=256)


# (width, n, length_penalty, early_stopping, stop tokens): stop tokens the tiny model emits often, so
# beams finish early and the length penalty and the stopping rules decide
CASES = [(2, 2, 1.0, False, None), (4, 3, 1.0, False, [397]), (4, 4, 0.5, True, [397, 446]),
         (8, 3, 2.0, "never", [397]), (3, 2, -1.0, False, [45]), (4, 2, 0.0, "never", [115])]


@pytest.mark.parametrize("width,n,penalty,early,eos", CASES)
def test_beams_match_hf_on_tiny_llama(llama, tiny_llama_dir, width, n, penalty, early, eos):
    prompt = random_prompt(7 + 5 * width, seed=width)
    ours = llama.generate({"prompt_token_ids": prompt}, beam_params(width, n, 20, penalty, early, eos))[0]
    assert_beams_match(ours, hf_beams(tiny_llama_dir, prompt, width, n, 20, penalty, early, eos))


@pytest.mark.parametrize("width,early", [(2, True), (5, False)])
def test_beams_match_hf_on_tiny_qwen2(tiny_qwen2_dir, width, early):
    prompt = random_prompt(33, seed=10 + width)
    ours = LLM(str(tiny_qwen2_dir), num_kv_blocks=256).generate(
        {"prompt_token_ids": prompt}, beam_params(width, 2, 16, 1.0, early, [7]))[0]
    assert_beams_match(ours, hf_beams(tiny_qwen2_dir, prompt, width, 2, 16, 1.0, early, [7]))


def test_beams_match_hf_with_repetition_penalty_and_min_tokens(llama, tiny_llama_dir):
    prompt = random_prompt(12, seed=3)
    params = beam_params(4, 2, 16, eos=[397], repetition_penalty=1.3, min_tokens=6)
    ours = llama.generate({"prompt_token_ids": prompt}, params)[0]
    assert all(len(o.token_ids) >= 6 for o in ours.outputs)
    assert_beams_match(ours, hf_beams(tiny_llama_dir, prompt, 4, 2, 16, eos=[397], repetition_penalty=1.3,
                                      min_new_tokens=6))


def test_cumulative_logprob_is_the_sum_of_the_returned_logprobs(llama):
    params = beam_params(3, 3, 10, eos=[397], logprobs=2)
    out = llama.generate({"prompt_token_ids": random_prompt(9, seed=4)}, params)[0]
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        assert o.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(o.logprobs, o.token_ids)), abs=1e-4)
        assert o.score == pytest.approx(o.cumulative_logprob / len(o.token_ids), abs=1e-4)  # length_penalty 1


def test_beams_share_blocks_and_copy_the_shared_last_block_on_write(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=16)
    engine = llm.engine
    prompt = random_prompt(100, seed=5)  # 6 full blocks + a partial one that the beams share
    engine.add_request("b", prompt, beam_params(4, 4, 24))
    peak_used, peak_shared = 0, 0
    while engine.has_unfinished():
        engine.step()
        assert_refcounts_match_tables(engine)
        summary = engine.block_manager.summary()
        peak_used, peak_shared = max(peak_used, summary["blocks_used"]), max(peak_shared, summary["blocks_shared"])
    independent = 4 * -(-(100 + 24) // 16)
    assert peak_shared >= 6  # at least the prompt's full blocks are held by every beam
    assert peak_used <= independent // 2
    assert engine.block_manager.stats.cow_copies >= 3  # the first fork: three of four beams copy block 7


def test_finished_beam_request_frees_every_block(llama):
    engine = llama.engine
    llama.generate({"prompt_token_ids": random_prompt(40, seed=6)}, beam_params(8, 2, 12, eos=[397]))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.requests


def test_beams_decode_in_the_same_batch_as_other_requests(tiny_llama_dir):
    prompts = [random_prompt(20 + i, seed=20 + i) for i in range(3)]
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)
    solo = LLM(str(tiny_llama_dir), num_kv_blocks=256)
    alone = [solo.generate({"prompt_token_ids": prompts[0]}, beam_params(4, 2, 16))[0],
             *solo.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy)]
    mixed = LLM(str(tiny_llama_dir), num_kv_blocks=256)
    outs = mixed.generate([{"prompt_token_ids": p} for p in prompts], [beam_params(4, 2, 16), greedy, greedy])
    assert mixed.engine.num_steps == 16  # one prefill step, then every step decodes all of them together
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in alone]


def test_beam_group_is_preempted_whole_and_gives_the_same_beams(tiny_llama_dir):
    prompts = [random_prompt(30, seed=30 + i) for i in range(3)]
    params = beam_params(4, 2, 40)
    roomy = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=8).generate(
        [{"prompt_token_ids": p} for p in prompts], params)
    tight = LLM(str(tiny_llama_dir), num_kv_blocks=30, block_size=8)
    engine = tight.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            finals[out.request_id] = out
        for req in engine.requests.values():  # a group is never split between running and waiting
            states = {s.status for s in req.seqs if not s.is_finished}
            assert len(states) <= 1
    assert engine.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in finals[str(i)].outputs] for i in range(3)] == \
        [[c.token_ids for c in o.outputs] for o in roomy]
    assert engine.block_manager.num_free_blocks == 30


def test_a_beam_group_split_by_the_token_budget_waits_for_its_last_beam(tiny_llama_dir):
    prompt = random_prompt(45, seed=40)
    params = beam_params(4, 4, 30)
    roomy = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=8).generate({"prompt_token_ids": prompt}, params)[0]
    # older greedy requests push the (newest) group out; its recompute, 4 beams x 45-75 tokens, spans
    # several 24-token steps
    tight = LLM(str(tiny_llama_dir), num_kv_blocks=36, block_size=8, max_num_batched_tokens=24)
    engine = tight.engine
    for i in range(3):
        engine.add_request(f"s{i}", random_prompt(60, seed=41 + i),
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=40))
    engine.add_request("r", prompt, params)
    waited, final = False, None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.request_id == "r" else final
        req = engine.requests.get("r")
        if req is not None and req.beam.pending and not req.beam.ready(req):
            waited = True  # some beams have their log-probs, the others are still computing
    assert engine.scheduler.num_preemptions > 0 and waited
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in roomy.outputs]


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", dict(temperature=0.7)),
    ("top_p", dict(top_p=0.9)),
    ("n", dict(n=3, beam_width=2)),
    ("beam_width", dict(beam_width=0)),
    ("stop", dict(stop=["."])),
])
def test_invalid_beam_params_raise_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{"mode": "beam", "beam_width": 2, **kwargs})


def test_beam_width_above_the_engine_maximum_is_refused(llama):
    with pytest.raises(ValueError, match="^beam_width: 9 is above"):
        llama.engine.add_request("x", [5, 6, 7], beam_params(9, 1, 4))


def test_cli_prints_every_beam_with_its_logprob_and_score(tiny_llama_dir, capsys):
    from engine_service.cli import main

    rc = main(["generate", "--model", str(tiny_llama_dir), "--num-kv-blocks", "64", "--prompt", "The capital",
               "--mode", "beam", "--beam-width", "3", "--n", "3", "--length-penalty", "0.5",
               "--early-stopping", "never", "--max-tokens", "6", "--ignore-eos"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 3
    assert all(f"[{i}]" in line and "cumulative_logprob=" in line and "score=" in line for i, line in enumerate(lines))
    scores = [float(line.rsplit("score=", 1)[1].split()[0].rstrip(")")) for line in lines]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.slow
@pytest.mark.parametrize("width,penalty,early,question", [
    (2, 1.0, False, "What is the capital of France? One word."),  # one beam stops at EOS, one at the length
    (4, 0.6, True, "Say hi."),
    (8, 1.5, "never", "Say hi."),
])
def test_smollm2_beams_match_hf(smollm2_llm, smollm2_dir, width, penalty, early, question):
    prompt = smollm2_llm.apply_chat_template([{"role": "user", "content": question}])
    params = SamplingParams(mode="beam", beam_width=width, n=2, max_tokens=10, length_penalty=penalty,
                            early_stopping=early)
    ours = smollm2_llm.generate(prompt, params)[0]
    assert_beams_match(ours, hf_beams(smollm2_dir, ours.prompt_token_ids, width, 2, 10, penalty, early,
                                      hf_default_eos(smollm2_dir)))
