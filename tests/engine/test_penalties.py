"""OpenAI's presence / frequency penalties and logit_bias, in every decoding mode, against references computed
by hand from Hugging Face's logits (transformers has no OpenAI-style presence penalty):

    logit[t] += bias[t] - presence * (count[t] > 0) - frequency * count[t]   (count: generated tokens only)
"""
import os

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from engine_service import LLM, SamplingParams
from tests.helpers import GREEDY, random_prompt
from tests.hf_oracle import hf_model

THREADS = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.8)
PROMPT = random_prompt(12, seed=5)


def openai_processed(logits: torch.Tensor, generated: list[int], presence: float, frequency: float,
                     bias: dict[int, float] | None = None) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[-1]).to(logits.dtype)
    out = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    for token, b in (bias or {}).items():
        out[token] += b
    return out


@torch.inference_mode()
def hand_greedy(model_dir, prompt: list[int], max_tokens: int, presence=0.0, frequency=0.0, bias=None):
    """Greedy decoding over HF's full-sequence logits with the penalties applied by hand: (ids, raw log-probs)."""
    model, ids, raw = hf_model(str(model_dir)), list(prompt), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(openai_processed(logits, ids[len(prompt):], presence, frequency, bias).argmax())
        raw.append(float(logits.log_softmax(-1)[token]))
        ids.append(token)
    return ids[len(prompt):], raw


class OpenAIPenalties(LogitsProcessor):
    """The same formula as an HF logits processor, for HF's beam search (which processes log-probs)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return torch.stack([openai_processed(row, ids[self.prompt_len:].tolist(), self.presence, self.frequency)
                            for row, ids in zip(scores, input_ids)])


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8, num_threads=THREADS)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    plain, _ = hand_greedy(tiny_llama_dir, PROMPT, 16)
    penalised, raw = hand_greedy(tiny_llama_dir, PROMPT, 16, **{k.split("_")[0]: v for k, v in PENALTIES.items()})
    assert penalised != plain, "the penalties must change this prompt's greedy output, or the tests prove nothing"
    return penalised, raw


def test_greedy_applies_the_penalties_to_generated_tokens(llm, reference):
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=16, logprobs=0, **PENALTIES,
                                                                    **GREEDY))[0].outputs[0]
    want, raw = reference
    assert out.token_ids == want
    # log-probs stay the model's own (raw), as vLLM reports them by default
    assert [lp[t] for t, lp in zip(out.token_ids, out.logprobs)] == pytest.approx(raw, abs=1e-4)


def test_the_prompt_tokens_are_not_counted(llm, tiny_llama_dir):
    prompt = [7] * 10  # a penalty counting the prompt would push token 7 down at once
    want, _ = hand_greedy(tiny_llama_dir, prompt, 8, presence=2.0, frequency=2.0)
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, presence_penalty=2.0,
                                                                    frequency_penalty=2.0, **GREEDY))[0]
    assert got.outputs[0].token_ids == want


def test_sampling_applies_them_before_the_draw(llm, reference):
    # top_k=1 at temperature 1 runs the sampling path, whose only candidate is the processed argmax
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=3, ignore_eos=True, **PENALTIES)
    assert llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids == reference[0]


def test_speculative_verification_counts_the_accepted_drafts(llm, reference):
    params = SamplingParams(max_tokens=16, mode="speculative", proposer="ngram", temperature=0.0, ngram_min=1,
                            ignore_eos=True, **PENALTIES)
    out = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    assert out.outputs[0].token_ids == reference[0]


def test_each_sequence_of_a_batch_counts_its_own_tokens(llm, reference):
    plain = SamplingParams(max_tokens=16, **GREEDY)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3,
                        [plain, SamplingParams(max_tokens=16, **PENALTIES, **GREEDY), plain])
    assert outs[1].outputs[0].token_ids == reference[0]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids != reference[0]


def test_logit_bias_is_added_before_sampling(llm, tiny_llama_dir):
    plain, _ = hand_greedy(tiny_llama_dir, PROMPT, 6)
    bias = {plain[0]: -100.0, 300: 3.0}
    want, _ = hand_greedy(tiny_llama_dir, PROMPT, 6, bias=bias)
    assert want[0] != plain[0]
    for params in (SamplingParams(max_tokens=6, logit_bias=bias, **GREEDY),
                   SamplingParams(max_tokens=6, logit_bias=bias, temperature=1.0, top_k=1, ignore_eos=True)):
        assert llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids == want


def test_a_plus_100_bias_forces_the_token(llm):
    params = SamplingParams(max_tokens=5, logit_bias={42: 100.0}, temperature=0.8, seed=1, ignore_eos=True)
    assert llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids == [42] * 5


@torch.inference_mode()
def test_beam_search_penalises_each_beams_log_probs_as_an_hf_processor_would(llm, tiny_llama_dir):
    prompt = PROMPT[:8]
    out = hf_model(str(tiny_llama_dir)).generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
        num_beams=3, num_return_sequences=2, max_new_tokens=8, eos_token_id=None, pad_token_id=0,
        logits_processor=LogitsProcessorList([OpenAIPenalties(len(prompt), 1.0, 0.5)]))
    theirs = [row[len(prompt):].tolist() for row in out]
    ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        mode="beam", beam_width=3, n=2, max_tokens=8, ignore_eos=True, presence_penalty=1.0,
        frequency_penalty=0.5))[0]
    assert [o.token_ids for o in ours.outputs] == theirs


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("presence_penalty", float("nan")), ("logit_bias", {5: 101.0}),
                                         ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0})])
def test_out_of_range_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_bias_for_a_token_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.add_request("too-big", PROMPT, SamplingParams(logit_bias={512: 1.0}))
    assert not llm.engine.has_unfinished()
