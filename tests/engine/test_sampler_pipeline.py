"""The sampler pipeline (pipeline.py, SamplingParams.sampler_stages): each stage's distribution is the one Hugging
Face's logits processors give on the same logits; rows that do not ask get nothing and draw the same tokens."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine_service.engine import LLM
from engine_service.engine.sampler import SamplingBatch, sample
from engine_service.engine.sampling_params import SamplingParams
from engine_service.server.events import sampler_stages
from shared.protocol import TokenEvent, decode_event, encode


def batch(rows: list[dict], seed: int) -> SamplingBatch:
    def col(name, default, dtype=torch.float32):
        return torch.tensor([r.get(name, default) for r in rows], dtype=dtype)

    seen = [r.get("seen", []) for r in rows]
    width = max(1, max(map(len, seen)))
    stages = [r.get("stages", 0) for r in rows]
    outs = [r.get("outputs", []) for r in rows]
    owidth = max(1, max(map(len, outs)))
    penalised = any(r.get("presence") or r.get("frequency") for r in rows)
    return SamplingBatch(
        temperature=col("temperature", 1.0), top_k=col("top_k", -1, torch.int64), top_p=col("top_p", 1.0),
        min_p=col("min_p", 0.0), repetition_penalty=col("rp", 1.0),
        seen_tokens=torch.tensor([s + [-1] * (width - len(s)) for s in seen]) if any(seen) else None,
        banned_tokens=[r.get("banned", []) for r in rows],
        generators=[torch.Generator().manual_seed(seed + i) for i in range(len(rows))], num_logprobs=0,
        logit_bias=[r.get("bias", {}) for r in rows] if any(r.get("bias") for r in rows) else None,
        stages=stages if any(stages) else None,
        output_tokens=torch.tensor([o + [-1] * (owidth - len(o)) for o in outs]) if penalised else None,
        presence_penalty=col("presence", 0.0) if penalised else None,
        frequency_penalty=col("frequency", 0.0) if penalised else None)


def openai_penalties(scores: torch.Tensor, row: dict) -> torch.Tensor:
    """HF has no presence / frequency processor: OpenAI's formula on the row's generated tokens."""
    counts = torch.bincount(torch.tensor(row["outputs"]), minlength=scores.shape[1]).to(scores.dtype)
    return scores - row.get("frequency", 0.0) * counts - row.get("presence", 0.0) * (counts > 0).to(scores.dtype)


def hf_stages(logits: torch.Tensor, row: dict) -> list[tuple[str, torch.Tensor]]:
    """The row's stages with HF's processors, in the sampler's order (those that change the row only)."""
    ids = torch.tensor([row.get("seen", [])], dtype=torch.int64)
    scores = logits[None].clone()
    out = [("raw", scores)]
    penalties = []
    if row.get("bias"):
        penalties.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in row["bias"].items()]))
    if row.get("rp", 1.0) != 1.0 and row.get("seen"):
        penalties.append(RepetitionPenaltyLogitsProcessor(row["rp"]))
    if (row.get("presence") or row.get("frequency")) and row.get("outputs"):
        penalties.append(lambda _, s: openai_penalties(s, row))
    if row.get("banned"):
        penalties.append(SuppressTokensLogitsProcessor(row["banned"]))
    for proc in penalties:
        scores = proc(ids, scores)
    if penalties:
        out.append(("penalties", scores))
    t, k, p, m = row.get("temperature", 1.0), row.get("top_k", -1), row.get("top_p", 1.0), row.get("min_p", 0.0)
    for name, on, proc in (("temperature", t != 1.0, lambda: TemperatureLogitsWarper(t)),
                           ("top_k", 0 < k < logits.shape[0], lambda: TopKLogitsWarper(k)),
                           ("top_p", p < 1.0, lambda: TopPLogitsWarper(p)),
                           ("min_p", m > 0, lambda: MinPLogitsWarper(m))):
        if on:
            scores = proc()(ids, scores)
            out.append((name, scores))
    return [(name, s[0]) for name, s in out]


row_settings = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0.3, 0.7, 1.0, 1.6]), "top_k": st.integers(1, 60),
    "top_p": st.sampled_from([0.5, 0.9, 0.99]), "min_p": st.sampled_from([0.02, 0.1, 0.3]),
    "rp": st.sampled_from([0.8, 1.3]), "seen": st.lists(st.integers(0, 49), min_size=1, max_size=8),
    "bias": st.dictionaries(st.integers(0, 49), st.sampled_from([-100.0, -2.0, 3.0]), min_size=1, max_size=3),
    "banned": st.lists(st.integers(0, 49), min_size=1, max_size=3, unique=True),
    "presence": st.sampled_from([-1.0, 0.5]), "frequency": st.sampled_from([-0.5, 1.5]),
    "outputs": st.lists(st.integers(0, 49), max_size=6),
})


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 16), rows=st.lists(st.tuples(row_settings, st.integers(1, 8)), min_size=1, max_size=4))
def test_each_stage_is_the_distribution_hf_processors_give(seed, rows):
    vocab = 50
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    cases = [dict(r, stages=n) for r, n in rows]
    out = sample(logits.clone(), batch(cases, seed))
    for i, case in enumerate(cases):
        token, ours, theirs = int(out.token_ids[i]), out.stages[i], hf_stages(logits[i], case)
        assert [s.name for s in ours] == [name for name, _ in theirs]
        prev = None
        for s, (name, scores) in zip(ours, theirs):
            probs = scores.softmax(dim=0)
            finite = scores.isfinite()
            assert s.kept == int(finite.sum()), name
            want = probs.topk(min(case["stages"], s.kept)).values
            torch.testing.assert_close(torch.tensor([p for _, p in s.top]), want[want > 0])
            torch.testing.assert_close(torch.tensor([probs[t] for t, _ in s.top]), want[want > 0])
            assert s.other == pytest.approx(1 - float(want.sum()), abs=1e-5)
            assert s.removed == pytest.approx(float(prev[~finite].sum()) if prev is not None else 0.0, abs=1e-5)
            assert s.chosen_prob == pytest.approx(float(probs[token]), abs=1e-5)
            assert s.chosen_rank == int((scores > scores[token]).sum())
            prev = probs
        assert ours[-1].chosen_prob > 0  # the drawn token survived every stage


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2 ** 16), rows=st.lists(st.tuples(row_settings, st.booleans()), min_size=2, max_size=5))
def test_rows_that_do_not_ask_get_no_stages_and_the_same_tokens(seed, rows):
    logits = torch.randn(len(rows), 50, generator=torch.Generator().manual_seed(seed)) * 3
    plain = [dict(r) for r, _ in rows]
    asked = [dict(r, stages=4 if ask else 0) for r, ask in rows]
    before = sample(logits.clone(), batch(plain, seed))
    after = sample(logits.clone(), batch(asked, seed))
    assert before.stages is None
    for i, (_, ask) in enumerate(rows):
        assert (after.stages is not None and after.stages[i] is not None) == ask
        if not ask:
            assert int(after.token_ids[i]) == int(before.token_ids[i])


def test_stage_names_follow_the_rows_own_settings():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, batch([dict(temperature=0.5, top_p=0.9, stages=3), dict(top_k=5, stages=3)], 0))
    assert [s.name for s in out.stages[0]] == ["raw", "temperature", "top_p"]
    assert [s.name for s in out.stages[1]] == ["raw", "top_k"]
    assert out.stages[1][1].kept == 5 and out.stages[1][1].removed > 0


def test_sampler_stages_is_validated():
    with pytest.raises(ValueError, match="sampler_stages"):
        SamplingParams(sampler_stages=-1)
    with pytest.raises(ValueError, match="sampler_stages"):
        SamplingParams(sampler_stages=4, mode="beam", temperature=0)


def test_engine_outputs_carry_one_pipeline_per_token(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    prompt = "The capital of France is"
    params = dict(temperature=0.8, top_k=40, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True)
    traced = llm.generate([prompt], SamplingParams(**params, sampler_stages=5))[0].outputs[0]
    plain = llm.generate([prompt], SamplingParams(**params))[0].outputs[0]
    assert plain.stages is None
    assert traced.token_ids == plain.token_ids
    assert len(traced.stages) == len(traced.token_ids) == 6
    for stages in traced.stages:
        assert [s["name"] for s in stages] == ["raw", "temperature", "top_k", "top_p"]
        assert len(stages[0]["top"]) == 5 and stages[2]["kept"] == 40
        assert stages[-1]["kept"] <= 40 and stages[-1]["chosen_prob"] > 0


class _Tok:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_token_events_carry_the_pipelines_with_the_tokens_text():
    engine = [[dict(name="raw", top=[(2, 0.6), (0, 0.3)], kept=3, removed=0.0, other=0.1, chosen_rank=1,
                    chosen_prob=0.3)]]
    stages = sampler_stages(_Tok(), engine)
    assert stages[0][0].top == [(2, "c", 0.6), (0, "a", 0.3)] and stages[0][0].chosen_rank == 1
    event = TokenEvent(request_id="r", seq=0, text_delta="a", token_ids=[0], stages=stages)
    assert decode_event(encode(event)).stages == stages
    assert sampler_stages(_Tok(), None) is None


def test_under_a_grammar_its_stage_removes_the_mass_the_engine_reports_as_masked(tiny_llama_dir):
    from engine_service.engine.sampling_params import StructuredOutputsParams

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    spec = StructuredOutputsParams(regex="[ab]{2}(c|de)[0-9]")
    out = llm.generate(["abc de ab 12 ba"], SamplingParams(
        temperature=0.9, seed=1, max_tokens=8, logprobs=1, structured_outputs=spec, presence_penalty=0.5,
        sampler_stages=4))[0].outputs[0]
    assert len(out.stages) == len(out.token_ids) == len(out.masked)
    for t, (stages, masked) in enumerate(zip(out.stages, out.masked)):
        penalised = ["penalties"] if t else []  # the presence penalty has generated tokens to act on from the second
        assert [s["name"] for s in stages] == ["raw", "grammar", *penalised, "temperature"]
        assert stages[1]["removed"] == pytest.approx(masked, abs=1e-4)
        assert stages[1]["kept"] < stages[0]["kept"] and stages[-1]["chosen_prob"] > 0
