"""Speculative sampling is lossless: its tokens follow the target's distribution (chi-square tests)."""
from collections import Counter

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from engine_service import LLM, SamplingParams
from engine_service.engine.spec_decode import verify
from hf_oracle import hf_model
from test_spec_decode import save_draft

P_MIN = 1e-3  # the tests are seeded, so deterministic: a p-value this low means a biased sampler


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """p-value of observed counts against expected probabilities; cells expecting < 5 are pooled."""
    n = sum(counts)
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for c, p in zip(counts, probs):
        if n * p < 5:
            pooled_obs, pooled_exp = pooled_obs + c, pooled_exp + n * p
        else:
            cells.append((c, n * p))
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2.0)))


def draws(n: int, fn) -> Counter:
    gen = torch.Generator().manual_seed(0)
    return Counter(fn(gen) for _ in range(n))


TARGET = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 1.0, 2.0, 0.5, 0.5, -1.0]])
DRAFT = torch.tensor([0.05, 0.05, 0.1, 0.4, 0.3, 0.1])  # far from the target on purpose


def test_verification_of_a_draft_model_token_follows_the_target_distribution():
    def first_token(gen):
        x = int(torch.multinomial(DRAFT, 1, generator=gen))
        return verify(TARGET, [x], DRAFT[None], greedy=False, generator=gen)[0][0]

    counts = draws(20000, first_token)
    p = TARGET[0].softmax(-1).tolist()
    assert chi_square_p([counts[t] for t in range(6)], p) > P_MIN


def test_verification_of_an_ngram_token_follows_the_target_distribution():
    counts = draws(20000, lambda gen: verify(TARGET, [3], None, greedy=False, generator=gen)[0][0])
    p = TARGET[0].softmax(-1).tolist()
    assert chi_square_p([counts[t] for t in range(6)], p) > P_MIN


def test_the_chi_square_check_catches_a_sampler_that_accepts_every_draft():
    counts = draws(20000, lambda gen: int(torch.multinomial(DRAFT, 1, generator=gen)))
    assert chi_square_p([counts[t] for t in range(6)], TARGET[0].softmax(-1).tolist()) < P_MIN


@torch.inference_mode()
def hf_joint(model_dir, prompt: list[int], top_k: int, temperature: float) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) under HF's processors (temperature, then top-k), by enumerating the top-k tree."""
    model = hf_model(str(model_dir))
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])

    def next_probs(ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids])
        return processors(x, model(x).logits[:, -1]).softmax(-1)[0]

    joint = {}
    p1 = next_probs(prompt)
    for t1 in p1.topk(top_k).indices.tolist():
        p2 = next_probs(prompt + [t1])
        for t2 in p2.topk(top_k).indices.tolist():
            p3 = next_probs(prompt + [t1, t2])
            for t3 in p3.topk(top_k).indices.tolist():
                joint[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return joint


def test_speculative_sampling_in_the_engine_follows_the_targets_distribution(tiny_llama_dir, tmp_path):
    draft = save_draft(tiny_llama_dir, tmp_path / "draft", noise=0.3)  # disagrees often: many rejections
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=1024, block_size=8, max_num_seqs=512, draft_model=str(draft))
    prompt = [17, 202, 45, 310, 99, 6, 451, 260]
    params = [SamplingParams(mode="speculative", proposer="draft", num_speculative_tokens=2, temperature=1.0,
                             top_k=3, seed=i, ignore_eos=True, max_tokens=4) for i in range(1500)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params)
    # t1 is sampled after the prefill; t2 and t3 come out of verification (accepted, resampled or bonus)
    samples = Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    marks = Counter(m for o in outs for m in o.outputs[0].spec_marks[1:3])
    assert marks["accepted"] > 300 and marks["resampled"] > 300
    joint = hf_joint(tiny_llama_dir, prompt, top_k=3, temperature=1.0)
    assert set(samples) <= set(joint)
    cells = sorted(joint)
    assert chi_square_p([samples[c] for c in cells], [joint[c] for c in cells]) > P_MIN


def test_seeded_speculative_sampling_is_reproducible(tiny_llama_dir, tmp_path):
    draft = save_draft(tiny_llama_dir, tmp_path / "draft", noise=0.1)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, draft_model=str(draft))
    params = SamplingParams(mode="speculative", proposer="draft", temperature=0.9, seed=11, max_tokens=20,
                            ignore_eos=True)
    a, b = (llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)[0].outputs[0] for _ in range(2))
    assert (a.token_ids, a.spec_marks) == (b.token_ids, b.spec_marks)
