"""Speculative sampling is lossless: every token, accepted draft, resampled or bonus, follows the target's
processed distribution (chi-square tests); and a seeded request's tokens do not depend on the batch."""
from collections import Counter

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from engine_service import LLM, SamplingParams
from engine_service.engine.sampler import SamplingBatch, position_noise, process_logits
from engine_service.engine.spec_decode import verify
from tests.engine.test_spec_decode import save_draft
from tests.helpers import random_prompt
from tests.hf_oracle import hf_model

P_MIN = 1e-3  # the tests are seeded, so deterministic: a p-value this low means a biased sampler
N = 40_000  # draws per synthetic test: enough to catch a 3% shift of one token's probability (power test)


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


def follows(counts: Counter, probs: torch.Tensor) -> float:
    return chi_square_p([counts[t] for t in range(len(probs))], probs.tolist())


# the target's processed logits at three positions of a 6-token vocabulary, and a draft far from them
TARGET = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 1.0, 2.0, 0.5, 0.5, -1.0],
                       [1.0, -0.5, 0.0, 2.0, 0.3, 0.3]])
FAR_DRAFT = torch.tensor([0.05, 0.05, 0.1, 0.4, 0.3, 0.1]).log().expand(3, 6)


def speculate(seed: int, target: torch.Tensor, draft: torch.Tensor | None, k: int,
              ngram: list[int] | None = None) -> tuple[list[int], list[str]]:
    """One verification as the engine runs it: the draft model proposes argmax(q_t / E_t) with the keyed
    noise E_t the target then draws with (an n-gram proposal is given); positions 0 .. k."""
    noise = torch.stack([position_noise(seed, t, target.shape[1]) for t in range(k + 1)])
    drafts = ngram if ngram is not None else (draft[:k].softmax(-1) / noise[:k]).argmax(-1).tolist()
    return verify(target[:k + 1], drafts, noise)


def test_a_token_after_a_draft_models_proposal_follows_the_target():
    counts = Counter(speculate(seed, TARGET, FAR_DRAFT, k=1)[0][0] for seed in range(N))
    assert follows(counts, TARGET[0].softmax(-1)) > P_MIN


def test_a_token_after_an_ngram_proposal_follows_the_target():
    counts = Counter(speculate(seed, TARGET, None, k=1, ngram=[3])[0][0] for seed in range(N))
    assert follows(counts, TARGET[0].softmax(-1)) > P_MIN


def test_the_bonus_token_after_every_draft_was_kept_follows_the_target():
    near_draft = TARGET + 0.3 * torch.randn(TARGET.shape, generator=torch.Generator().manual_seed(1))
    runs = [speculate(seed, TARGET, near_draft, k=2) for seed in range(N)]
    bonus = Counter(tokens[2] for tokens, marks in runs if marks[-1] == "bonus")
    assert sum(bonus.values()) > N // 4
    assert follows(bonus, TARGET[2].softmax(-1)) > P_MIN


def test_tokens_at_temperature_0_7_with_top_k_and_top_p_follow_hfs_processors():
    raw = torch.randn(2, 12, generator=torch.Generator().manual_seed(2)) * 2
    draft_raw = raw + 0.5 * torch.randn(2, 12, generator=torch.Generator().manual_seed(3))
    batch = SamplingBatch(temperature=torch.tensor([0.7, 0.7]), top_k=torch.tensor([6, 6]),
                          top_p=torch.tensor([0.9, 0.9]), min_p=torch.tensor([0.0, 0.0]),
                          repetition_penalty=torch.tensor([1.0, 1.0]), seen_tokens=None, banned_tokens=[[], []],
                          generators=[None, None], num_logprobs=0)
    target, draft = process_logits(raw.clone(), batch), process_logits(draft_raw.clone(), batch)
    hf = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), TopPLogitsWarper(0.9)])
    expected = hf(torch.zeros(2, 1, dtype=torch.long), raw.clone()).softmax(-1)
    runs = [speculate(seed, target, draft, k=1) for seed in range(N)]
    assert follows(Counter(tokens[0] for tokens, _ in runs), expected[0]) > P_MIN
    second = Counter(tokens[1] for tokens, marks in runs if marks[-1] == "bonus")  # the bonus, at position 1
    assert sum(second.values()) > N // 10 and follows(second, expected[1]) > P_MIN


def test_the_chi_square_check_catches_a_three_percent_bias():
    p = TARGET[0].softmax(-1)
    biased = p.clone()
    biased[0] += 0.03
    draws = torch.multinomial(biased / biased.sum(), N, replacement=True, generator=torch.Generator().manual_seed(4))
    assert follows(Counter(draws.tolist()), p) < P_MIN


def test_the_chi_square_check_catches_a_sampler_that_keeps_every_draft():
    drafts = Counter(int((FAR_DRAFT[0].softmax(-1) / position_noise(seed, 0, 6)).argmax()) for seed in range(N))
    assert follows(drafts, TARGET[0].softmax(-1)) < P_MIN


@pytest.fixture(scope="module")
def near_draft_dir(tiny_llama_dir, tmp_path_factory):
    return save_draft(tiny_llama_dir, tmp_path_factory.mktemp("near_draft"), noise=0.1)


@torch.inference_mode()
def randomized_pit(model_dir, prompt: list[int], generated: list[int], processors, gen) -> torch.Tensor:
    """Per generated token y_t: the mass HF's processed p_t puts on tokens likelier than y_t, plus V * p_t(y_t),
    V ~ U(0, 1). For tokens drawn from p_t these are i.i.d. U(0, 1) whatever the context; a sampler too
    sharp (or too flat) piles them near 0 (or spreads them toward 1)."""
    ids = torch.tensor([prompt + generated])
    logits = hf_model(str(model_dir))(ids).logits[0, len(prompt) - 1:-1]
    p = processors(ids[:, :1].expand(len(generated), 1), logits).softmax(-1)
    mass = p.gather(1, torch.tensor(generated)[:, None])
    assert (mass > 0).all(), "a token HF's processors filter out was generated"
    above = torch.where(p > mass, p, 0.0).sum(-1)
    return (above + torch.rand(len(generated), generator=gen, dtype=p.dtype) * mass[:, 0]).clamp(0, 1)


def uniform_p(u: torch.Tensor, bins: int = 10) -> float:
    counts = torch.histc(u.clamp(0, 1 - 1e-9), bins=bins, min=0, max=1).long().tolist()
    return chi_square_p(counts, [1 / bins] * bins)


PROMPT = [17, 202, 45, 310, 99, 6, 451, 260]


def hf_processors(temperature: float) -> LogitsProcessorList:
    return LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(40), TopPLogitsWarper(0.9)])


@pytest.fixture(scope="module")
def engine_samples(tiny_llama_dir, near_draft_dir):
    """12 seeded speculative requests at temperature 0.7, top-k 40, top-p 0.9: 600 tokens."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=512, block_size=8, draft_model=str(near_draft_dir))
    # one draft a step: about a third are kept, each followed by a bonus
    params = [SamplingParams(mode="speculative", proposer="draft", num_speculative_tokens=1, temperature=0.7,
                             top_k=40, top_p=0.9, seed=s, ignore_eos=True, max_tokens=50) for s in range(12)]
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params)]


def pits(model_dir, outputs, processors) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.cat([randomized_pit(model_dir, PROMPT, o.token_ids, processors, gen) for o in outputs])


def test_speculative_sampling_in_the_engine_follows_hfs_processed_distribution(tiny_llama_dir, engine_samples):
    marks = [m for o in engine_samples for m in o.spec_marks]
    assert min(Counter(marks)[m] for m in ("accepted", "resampled", "bonus")) > 50  # every path ran
    u = pits(tiny_llama_dir, engine_samples, hf_processors(0.7))
    assert uniform_p(u) > P_MIN
    # bonus tokens alone follow the target too (accepted or resampled alone do not: each is conditioned)
    assert uniform_p(u[torch.tensor([m == "bonus" for m in marks])], bins=5) > P_MIN


def test_the_engine_check_catches_a_temperature_off_by_a_tenth(tiny_llama_dir, engine_samples):
    assert uniform_p(pits(tiny_llama_dir, engine_samples, hf_processors(0.8))) < P_MIN


def test_seeded_speculative_sampling_is_reproducible(tiny_llama_dir, near_draft_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, draft_model=str(near_draft_dir))
    params = SamplingParams(mode="speculative", proposer="draft", temperature=0.9, seed=11, max_tokens=20,
                            ignore_eos=True)
    a, b = (llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)[0].outputs[0] for _ in range(2))
    assert (a.token_ids, a.spec_marks) == (b.token_ids, b.spec_marks)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_seeded_speculative_request_gives_the_same_tokens_whatever_else_runs(tiny_llama_dir, near_draft_dir,
                                                                                proposer):
    # a budget of 6 tokens: alone the request verifies 4 drafts a step; behind five decodes none fit
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=8, max_num_batched_tokens=6,
              draft_model=str(near_draft_dir))
    prompt = {"prompt_token_ids": random_prompt(10, seed=8) * 3}  # repeats: the n-gram lookup finds matches
    params = SamplingParams(mode="speculative", proposer=proposer, num_speculative_tokens=4, temperature=0.8,
                            top_k=5, seed=5, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompt, params)[0]
    crowd = [{"prompt_token_ids": random_prompt(6, seed=20 + i)} for i in range(5)]
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40)
    behind = llm.generate(crowd + [prompt], [greedy] * 5 + [params])[-1]
    assert behind.metrics.spec["proposed"] < alone.metrics.spec["proposed"]  # the drafts did differ
    assert behind.outputs[0].token_ids == alone.outputs[0].token_ids
