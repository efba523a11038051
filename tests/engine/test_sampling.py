"""Sampling: the processors equal Hugging Face's, draws follow the processed distribution, seeds are
reproducible whatever the batch, and the request-level stops (min_tokens, stop strings, stop ids,
max_tokens, n) behave like vLLM's."""
import os
from dataclasses import replace

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine_service import LLM, SamplingParams
from engine_service.engine.sampler import SamplingBatch, process_logits, sample
from tests.helpers import GREEDY
from tests.hf_oracle import hf_model

THREADS = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
VOCAB = 64

CASES = [
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.3, min_p=0.1),
    dict(temperature=0.5, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_p=0.5, repetition_penalty=1.3),
    dict(temperature=0.9, min_p=0.3, repetition_penalty=0.8),
    dict(temperature=2.0, top_k=1),
]
SEEN = [[0, 5, 5, 9], [1], [0, 2, 3, 4, 5, 6], [7]]  # includes token 0 and short (padded) rows


def make_batch(cases: list[dict], seen: list[list[int]] | None = None, banned=None, generators=None,
               num_logprobs: int = 0) -> SamplingBatch:
    def col(name, default, dtype=torch.float32):
        return torch.tensor([c.get(name, default) for c in cases], dtype=dtype)

    seen_tokens = None
    if seen is not None:
        width = max(map(len, seen))
        seen_tokens = torch.tensor([s + [-1] * (width - len(s)) for s in seen], dtype=torch.int64)
    return SamplingBatch(
        temperature=col("temperature", 1.0), top_k=col("top_k", -1, torch.int64), top_p=col("top_p", 1.0),
        min_p=col("min_p", 0.0), repetition_penalty=col("repetition_penalty", 1.0), seen_tokens=seen_tokens,
        banned_tokens=banned or [[] for _ in cases], generators=generators or [None] * len(cases),
        num_logprobs=num_logprobs)


def hf_process(logits: torch.Tensor, case: dict, seen: list[int]) -> torch.Tensor:
    """One row through Hugging Face's own processors, in generate()'s order."""
    procs = []
    if case.get("repetition_penalty", 1.0) != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
    if case.get("temperature", 1.0) not in (0.0, 1.0):  # 0: greedy, no warper
        procs.append(TemperatureLogitsWarper(case["temperature"]))
    if case.get("top_k", -1) > 0:
        procs.append(TopKLogitsWarper(case["top_k"]))
    if case.get("top_p", 1.0) < 1.0:
        procs.append(TopPLogitsWarper(case["top_p"]))
    if case.get("min_p", 0.0) > 0:
        procs.append(MinPLogitsWarper(case["min_p"]))
    scores, ids = logits[None].clone(), torch.tensor([seen], dtype=torch.int64)
    for proc in procs:
        scores = proc(ids, scores)
    return scores[0]


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processed_logits_keep_exactly_the_support_hf_keeps(seed):
    logits = random_logits(len(CASES), seed)
    seen = [SEEN[i % len(SEEN)] for i in range(len(CASES))]
    ours = process_logits(logits.clone(), make_batch(CASES, seen))  # all the cases in one batch
    for row, case in enumerate(CASES):
        theirs = hf_process(logits[row], case, seen[row])
        assert torch.equal(ours[row].isfinite(), theirs.isfinite()), case
        kept = theirs.isfinite()
        torch.testing.assert_close(ours[row][kept], theirs[kept])


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_equals_hf_on_padded_rows(penalty):
    logits = random_logits(len(SEEN), 3)
    case = dict(repetition_penalty=penalty)
    ours = process_logits(logits.clone(), make_batch([case] * len(SEEN), SEEN))
    for row, seen in enumerate(SEEN):
        assert torch.equal(ours[row], hf_process(logits[row], case, seen)), f"row {row}, seen {seen}"


@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-30, 1e30, 1e300])
@pytest.mark.parametrize("temperature", [1.0, 1e-5])
def test_an_extreme_repetition_penalty_keeps_every_logit_finite_and_every_ban(penalty, temperature):
    """What validation lets through (any finite penalty > 0; 5e-324 is 0 in float32) leaves no +inf or NaN for the
    draw (an engine error under a grammar's mask, found by the API fuzz test), and no banned token unbanned."""
    logits = random_logits(len(SEEN), 5)
    logits[:, 0] = 0.0  # 0 / a penalty of 0 would be NaN
    logits[:, 5] = float("-inf")  # banned (a grammar, min_tokens), and seen in rows 0 and 2
    batch = make_batch([dict(repetition_penalty=penalty, temperature=temperature)] * len(SEEN), SEEN)
    ours = process_logits(logits.clone(), batch)
    assert not ours.isnan().any() and not ours.isposinf().any()
    assert ours[:, 5].isneginf().all() and ours[:, [i for i in range(VOCAB) if i != 5]].isfinite().all()
    drawn = sample(logits.clone(), batch).token_ids.tolist()
    for row, (token, seen) in enumerate(zip(drawn, SEEN)):
        assert token != 5
        favoured = [t for t in seen if t != 5 and logits[row, t] > 0]
        if penalty < 1 and favoured:  # a tiny penalty makes seen positive logits win outright
            assert token in favoured, (row, token, seen)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_2000_draws_land_only_in_the_support(case):
    torch.manual_seed(0)
    logits = random_logits(1, 4)
    support = set(hf_process(logits[0], case, SEEN[0]).isfinite().nonzero().flatten().tolist())
    n = 2000
    out = sample(logits.expand(n, VOCAB).clone(), make_batch([case] * n, [SEEN[0]] * n))
    drawn = set(out.token_ids.tolist())
    assert drawn <= support
    assert len(support) == 1 or len(drawn) > 1  # really sampling, not collapsed to one token


@pytest.mark.parametrize("case", [dict(temperature=0.6), dict(temperature=1.0), dict(temperature=1.7),
                                  dict(temperature=0.8, top_k=3), dict(temperature=1.0, top_p=0.8),
                                  dict(temperature=0.9, min_p=0.2)])
def test_samples_follow_the_processed_softmax(case):
    # rows that top-k, top-p or min-p cut race among their kept tokens only (sampler._race): same distribution
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.5]])
    n = 20_000
    torch.manual_seed(1234)
    out = sample(logits.expand(n, 6).clone(), make_batch([case] * n))
    expected = hf_process(logits[0], case, []).double().softmax(-1) * n
    counts = torch.bincount(out.token_ids, minlength=6).double()
    support = expected > 0
    assert (counts[~support] == 0).all()
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    critical_p001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[int(support.sum()) - 1]
    assert chi2 < critical_p001, (chi2, counts.tolist(), expected.tolist())


def test_greedy_rows_ignore_the_sampling_rows_beside_them():
    logits = random_logits(6, 5)
    greedy, penalised = dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=3.0)
    cases = [greedy, dict(temperature=1.5, top_k=3), penalised, dict(temperature=0.8, top_p=0.5, min_p=0.2),
             greedy, dict(temperature=1.0, repetition_penalty=0.5)]
    seen = [[1], [2, 3], [int(logits[2].argmax())], [4], [5], [6]]
    expected = [int(logits[0].argmax()), int(hf_process(logits[2], penalised, seen[2]).argmax()),
                int(logits[4].argmax())]
    assert expected[1] != int(logits[2].argmax())  # the penalty moved the greedy choice
    for seed in range(5):
        torch.manual_seed(seed)
        out = sample(logits.clone(), make_batch(cases, seen))
        assert out.token_ids[[0, 2, 4]].tolist() == expected


def test_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch():
    case = dict(temperature=1.0, top_p=0.95)
    steps = [random_logits(1, 10 + i) for i in range(6)]

    def run(layout: list[str]) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        other = torch.Generator().manual_seed(99)
        tokens = []
        for step, logits in enumerate(steps):
            rows = [logits[0] if who == "me" else random_logits(1, 100 + step)[0] for who in layout]
            gens = [gen if who == "me" else other if who == "seeded" else None for who in layout]
            cases = [case if who == "me" else dict(temperature=0.0) if who == "greedy" else dict(temperature=1.2)
                     for who in layout]
            out = sample(torch.stack(rows), make_batch(cases, generators=gens))
            tokens.append(int(out.token_ids[layout.index("me")]))
        return tokens

    alone = run(["me"])
    assert run(["other", "me", "seeded", "greedy"]) == alone
    assert run(["greedy", "seeded", "other", "other", "me"]) == alone
    assert len(set(alone)) > 1


def test_banned_tokens_are_never_drawn_even_when_most_likely():
    logits = random_logits(1, 6)
    top = int(logits.argmax())
    n = 2000
    out = sample(logits.expand(n, VOCAB).clone(), make_batch([dict(temperature=0.3)] * n, banned=[[top]] * n))
    assert top not in out.token_ids.tolist()
    assert out.logprobs[0] == logits.log_softmax(-1)[0, out.token_ids[0]]  # logprobs stay raw


def test_sampler_logprobs_are_the_raw_log_softmax():
    logits = random_logits(3, 8)
    out = sample(logits.clone(), make_batch([dict(temperature=0.0), dict(temperature=1.0, top_k=2),
                                             dict(temperature=3.0)], num_logprobs=4))
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, raw.topk(4, dim=1).values)
    assert torch.equal(out.top_ids, raw.topk(4, dim=1).indices)


@pytest.mark.parametrize("cases", [
    [dict(temperature=0.0), dict(temperature=1.0, top_k=2)],  # no division by a temperature: top-k on a copy
    [dict(temperature=1.0, top_p=0.5), dict(temperature=1.0, min_p=0.2), dict(temperature=0.0)],
    [dict(temperature=1.0), dict(temperature=0.0)],  # nothing to process: the logits themselves, read only
])
def test_processing_never_writes_into_the_logits_the_raw_logprobs_come_from(cases):
    logits = random_logits(len(cases), 50)
    given = logits.clone()
    out = sample(given, make_batch(cases, num_logprobs=3))
    assert torch.equal(given, logits)
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, raw.topk(3, dim=1).values)


def test_sampling_works_when_the_logits_live_on_another_device_than_the_batch():
    # the engine builds the batch (and the seeded generators) on the CPU; on a GPU the logits are on the
    # GPU. The meta device stands in for it: mixing devices raises there just as it does on CUDA.
    cases = [dict(temperature=0.0), dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
             dict(temperature=1.0)]
    batch = make_batch(cases, seen=[[1], [2, 3], [4]], banned=[[], [5], []],
                       generators=[None, torch.Generator().manual_seed(0), None], num_logprobs=2)
    out = sample(random_logits(3, 12).to("meta"), batch)
    assert out.token_ids.device.type == "meta" and out.token_ids.shape == (3,)
    assert out.top_ids.shape == (3, 2)


# ---- through the engine, with the tiny Llama

PROMPT = "Once upon a time"
GREEDY_12 = SamplingParams(max_tokens=12, **GREEDY)
STOPPABLE = SamplingParams(temperature=0.0, max_tokens=12)  # greedy that EOS and stops may end early


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8, num_threads=THREADS)


@pytest.fixture(scope="module")
def greedy_ref(llm):
    out = llm.generate(PROMPT, GREEDY_12)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY_12.max_tokens
    return out


def first_output(llm, prompt, params):
    return llm.generate(prompt, params)[0].outputs[0]


def test_seeded_request_gives_the_same_tokens_alone_or_batched(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
    alone = first_output(llm, PROMPT, params).token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=5, **GREEDY),
              SamplingParams(temperature=1.2, seed=11, max_tokens=8, ignore_eos=True, repetition_penalty=1.2)]
    batched = llm.generate(["The capital of France is", PROMPT, "def fibonacci(n):", "Readability counts."],
                           [others[0], params, others[1], others[2]])
    assert batched[1].outputs[0].token_ids == alone
    assert first_output(llm, PROMPT, replace(params, seed=12)).token_ids != alone


def test_greedy_request_is_unaffected_by_sampled_requests_in_its_batch(llm, greedy_ref):
    sampled = SamplingParams(temperature=1.5, top_k=10, min_p=0.05, repetition_penalty=1.3, max_tokens=12,
                             ignore_eos=True)
    outs = llm.generate(["Readability counts.", PROMPT, "The quick brown fox"],
                        [sampled, GREEDY_12, sampled])
    assert outs[1].outputs[0].token_ids == greedy_ref.token_ids


def test_logprobs_give_the_top_n_plus_the_chosen_token(llm, tiny_llama_dir):
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True, logprobs=2)
    greedy = SamplingParams(max_tokens=8, logprobs=0, **GREEDY)
    outs = llm.generate([PROMPT, PROMPT], [sampled, greedy])
    for out, n in zip(outs, [2, 0]):
        o = out.outputs[0]
        ids = out.prompt_token_ids + o.token_ids
        with torch.inference_mode():
            raw = hf_model(str(tiny_llama_dir))(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert len(o.logprobs) == len(o.token_ids)
        for i, (token, entry) in enumerate(zip(o.token_ids, o.logprobs)):
            row = raw[len(out.prompt_token_ids) - 1 + i]
            assert set(entry) == set(row.topk(n).indices.tolist()) | {token}
            for t, lp in entry.items():
                assert lp == pytest.approx(float(row[t]), abs=1e-4)
        assert o.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(o.token_ids, o.logprobs)), abs=1e-4)
    assert any(len(d) == 3 for d in outs[0].outputs[0].logprobs)  # a sampled token outside the top 2


def test_min_tokens_suppresses_eos(llm, greedy_ref, monkeypatch):
    eos = greedy_ref.token_ids[0]
    monkeypatch.setattr(llm.engine, "eos_token_ids", {eos})  # as if the model's first choice were EOS
    stopped = first_output(llm, PROMPT, STOPPABLE)
    assert (stopped.token_ids, stopped.finish_reason) == ([eos], "stop")
    held = first_output(llm, PROMPT, replace(STOPPABLE, min_tokens=4))
    assert eos not in held.token_ids[:4] and len(held.token_ids) >= 4
    assert held.finish_reason == ("stop" if eos in held.token_ids else "length")


def test_stop_string_truncates_the_text_and_finishes_with_stop(llm, greedy_ref):
    full = greedy_ref.text
    at = next(i for i in range(3, len(full) - 2)
              if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    out = first_output(llm, PROMPT, replace(STOPPABLE, stop=[full[at:at + 2], "never appears"]))
    assert (out.text, out.finish_reason) == (full[:at], "stop")
    assert len(out.token_ids) < len(greedy_ref.token_ids)
    assert out.token_ids == greedy_ref.token_ids[:len(out.token_ids)]


def test_stop_token_id_ends_the_output_with_that_token(llm, greedy_ref):
    ref = greedy_ref.token_ids
    j = next(j for j in range(3, len(ref)) if ref[j] not in ref[:j])
    out = first_output(llm, PROMPT, replace(STOPPABLE, stop_token_ids=[ref[j]]))
    assert (out.token_ids, out.finish_reason) == (ref[:j + 1], "stop")


def test_max_tokens_finishes_with_length(llm):
    out = first_output(llm, PROMPT, SamplingParams(temperature=0.7, seed=1, max_tokens=3, ignore_eos=True))
    assert (len(out.token_ids), out.finish_reason) == (3, "length")


def test_n_samples_give_n_outputs_and_free_their_blocks(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert [o.token_ids for o in llm.generate(PROMPT, params)[0].outputs] == [o.token_ids for o in out.outputs]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
