"""Per-token entropy: the nats of the raw next-token distribution, computed by the sampler only when a request
asks for logprobs, carried on CompletionOutput.entropies and on the wire's TokenLogprob.entropy."""
import math

import torch

from engine_service import LLM, SamplingParams
from engine_service.engine.sampler import SamplingBatch, entropy, sample
from engine_service.server.events import token_logprobs


def _batch(rows: int, want: bool) -> SamplingBatch:
    return SamplingBatch(temperature=torch.zeros(rows), top_k=torch.full((rows,), -1), top_p=torch.ones(rows),
                         min_p=torch.zeros(rows), repetition_penalty=torch.ones(rows), seen_tokens=None,
                         banned_tokens=[[] for _ in range(rows)], generators=[None] * rows, num_logprobs=0,
                         entropy=want)


def test_entropy_equals_torch_categorical_entropy():
    logits = torch.randn(4, 97, generator=torch.Generator().manual_seed(0)) * 3
    got = entropy(logits.log_softmax(dim=-1))
    want = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_entropy_counts_impossible_tokens_as_zero():
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    assert math.isclose(float(entropy(logits.log_softmax(dim=-1))[0]), math.log(2), rel_tol=1e-6)


def test_sampler_reports_entropy_only_when_asked():
    logits = torch.randn(3, 50)
    assert sample(logits.clone(), _batch(3, want=False)).entropy is None
    out = sample(logits.clone(), _batch(3, want=True))
    torch.testing.assert_close(out.entropy, torch.distributions.Categorical(logits=logits).entropy())


def test_engine_outputs_carry_one_entropy_per_token_with_logprobs(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    prompt = "The capital of France is"
    with_lp = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0].outputs[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert plain.entropies is None
    assert len(with_lp.entropies) == len(with_lp.token_ids) == 6
    assert all(0.0 <= e <= math.log(512) + 1e-4 for e in with_lp.entropies)
    spec = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2, mode="speculative",
                                                 proposer="ngram"))[0].outputs[0]
    assert spec.token_ids == with_lp.token_ids
    assert [round(e, 3) for e in spec.entropies] == [round(e, 3) for e in with_lp.entropies]


def test_beams_carry_the_entropy_of_their_parent_beams_distribution(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    prompt = "The capital of France is"
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0].outputs[0]
    beams = llm.generate([prompt], SamplingParams(mode="beam", beam_width=3, n=3, max_tokens=6, logprobs=2,
                                                  ignore_eos=True))[0].outputs
    assert len(beams) == 3
    for b in beams:
        assert len(b.entropies) == len(b.token_ids) == len(b.logprobs)
        # every beam's first token came from the prompt's distribution, which greedy's first token did too
        assert math.isclose(b.entropies[0], greedy.entropies[0], rel_tol=1e-4)
    no_lp = llm.generate([prompt], SamplingParams(mode="beam", beam_width=2, max_tokens=4))[0].outputs[0]
    assert no_lp.entropies is None


class _Tok:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_wire_records_carry_the_entropy_and_default_to_none():
    recs = token_logprobs(_Tok(), [1, 2], [{1: -0.1}, {2: -0.2}], [0.5, float("nan")])
    assert [r.entropy for r in recs] == [0.5, None]
    assert token_logprobs(_Tok(), [1], [{1: -0.1}])[0].entropy is None
