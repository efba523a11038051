"""Draft checks (spec_decode.draft_checks): per drafted token, p_target, p_draft and the textbook acceptance
min(1, p/q) against Hugging Face running the target and the draft; the residual; the by-position counters;
and the checks change no token."""
import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.engine import spec_decode
from engine_service.engine.sampler import position_noise
from engine_service.engine.sequence import SpecStats
from tests.engine.test_spec_decode import save_draft
from tests.helpers import random_prompt
from tests.hf_oracle import hf_model

TEMPERATURE = 0.8
PROMPTS = [random_prompt(12, seed=s) * 2 for s in range(4)]  # repeats: the n-gram lookup finds matches


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir, tmp_path_factory):
    return save_draft(tiny_llama_dir, tmp_path_factory.mktemp("checks_draft"), noise=0.05)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, draft_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=256, block_size=8, draft_model=str(draft_dir))


def spec(proposer: str, temperature: float = TEMPERATURE, seed: int | None = 7, k: int = 4) -> SamplingParams:
    return SamplingParams(mode="speculative", proposer=proposer, num_speculative_tokens=k, temperature=temperature,
                          seed=seed, max_tokens=30, ignore_eos=True)


def run(llm, params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)


@torch.inference_mode()
def hf_probs(model_dir, prompt: list[int], generated: list[int], temperature: float) -> torch.Tensor:
    """[len(generated), vocab]: HF's softmax(logits / T) at each generated token's position (T 1 for greedy)."""
    logits = hf_model(str(model_dir))(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]
    return (logits / temperature).softmax(-1)


def target_and_draft(target_dir, draft_dir, prompt: list[int], out) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's p and q at every generated position of `out`."""
    generated = out.outputs[0].token_ids
    return (hf_probs(target_dir, prompt, generated, TEMPERATURE), hf_probs(draft_dir, prompt, generated, TEMPERATURE))


def checked(out):
    """(token index, check) for every token a draft check produced."""
    return [(i, c) for i, c in enumerate(out.outputs[0].drafts) if c is not None]


def close(a: float, b) -> bool:
    return a == pytest.approx(float(b), rel=2e-3, abs=1e-6)


def test_draft_model_checks_match_p_and_q_computed_by_hf(llm, tiny_llama_dir, draft_dir):
    n = 0
    for prompt, out in zip(PROMPTS, run(llm, spec("draft"))):
        p, q = target_and_draft(tiny_llama_dir, draft_dir, prompt, out)
        for i, c in checked(out):
            x = c["draft_token_id"]
            # the draft is the draft model's coupled draw at that position (so p_draft is its q of it)
            assert x == int((q[i] / position_noise(7, len(prompt) + i, q.shape[1])).argmax())
            assert close(c["p_target"], p[i, x]) and close(c["p_draft"], q[i, x])
            assert close(c["accept_prob"], min(1.0, float(p[i, x] / q[i, x])))
            n += 1
    assert n > 20


def test_a_kept_draft_is_the_token_and_a_rejected_one_gives_way_to_the_targets(llm):
    for out in run(llm, spec("draft")):
        o = out.outputs[0]
        assert len(o.drafts) == len(o.token_ids) == len(o.spec_marks)
        for token, mark, c in zip(o.token_ids, o.spec_marks, o.drafts):
            assert (c is None) == (mark in ("target", "bonus"))
            if mark == "accepted":
                assert c["accepted"] and c["draft_token_id"] == token and c["residual_token_id"] is None
            if mark == "resampled":
                assert not c["accepted"] and c["draft_token_id"] != token == c["residual_token_id"]


def test_the_residual_is_max_of_p_minus_q_renormalised(llm, tiny_llama_dir, draft_dir):
    rejected = 0
    for prompt, out in zip(PROMPTS, run(llm, spec("draft"))):
        p, q = target_and_draft(tiny_llama_dir, draft_dir, prompt, out)
        residual = (p - q).clamp_min(0)
        residual /= residual.sum(-1, keepdim=True)
        for i, c in checked(out):
            if c["accepted"]:
                continue
            rejected += 1
            top = c["residual_top"]
            assert len(top) == 5 and sum(v for _, v in top) <= 1 + 1e-6
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert all(p[i, t] > q[i, t] and close(v, residual[i, t]) for t, v in top)
            assert close(top[-1][1], float(residual[i].topk(5).values[-1]))  # none better was left out
    assert rejected > 5


def test_ngram_checks_have_no_q_and_accept_with_p(llm, tiny_llama_dir):
    n = 0
    for prompt, out in zip(PROMPTS, run(llm, spec("ngram"))):
        generated = out.outputs[0].token_ids
        p = hf_probs(tiny_llama_dir, prompt, generated, TEMPERATURE)
        for i, c in checked(out):
            x = c["draft_token_id"]
            assert c["p_draft"] is None and close(c["p_target"], p[i, x]) and close(c["accept_prob"], p[i, x])
            if not c["accepted"]:  # the residual of a point mass: p without x
                assert x not in [t for t, _ in c["residual_top"]]
                assert all(close(v, p[i, t] / (1 - p[i, x])) for t, v in c["residual_top"])
            n += 1
    assert n > 3


def test_greedy_checks_accept_the_argmax_only_and_their_residual_is_the_targets_token(llm, tiny_llama_dir):
    seen = set()
    for prompt, out in zip(PROMPTS, run(llm, spec("draft", temperature=0, seed=None))):
        generated = out.outputs[0].token_ids
        p = hf_probs(tiny_llama_dir, prompt, generated, 1.0)
        for i, c in checked(out):
            x = c["draft_token_id"]
            assert close(c["p_target"], p[i, x])
            assert c["accept_prob"] == float(x == int(p[i].argmax())) == float(c["accepted"])
            if not c["accepted"]:
                assert c["residual_top"] == [(generated[i], 1.0)]
            seen.add(c["accepted"])
    assert seen == {True, False}


def test_positions_count_from_zero_in_each_verification(llm):
    for out in run(llm, spec("draft")):
        expected = 0
        for c in out.outputs[0].drafts:
            if c is None:
                expected = 0
                continue
            assert c["position"] == expected < 4
            expected = expected + 1 if c["accepted"] else 0


def test_by_position_counters_add_up_to_the_totals(llm):
    totals = llm.engine.spec.totals
    before = (totals.proposed, totals.accepted, sum(totals.proposed_by_position), sum(totals.accepted_by_position))
    for out in run(llm, spec("draft")):
        m, checks = out.metrics.spec, [c for c in out.outputs[0].drafts if c is not None]
        proposed, accepted = m["proposed_by_position"], m["accepted_by_position"]
        assert len(proposed) == len(accepted) == 4
        assert (sum(proposed), sum(accepted)) == (m["proposed"], m["accepted"])
        assert proposed[0] == m["steps"]
        assert proposed == sorted(proposed, reverse=True) and accepted == sorted(accepted, reverse=True)
        assert accepted == [sum(c["accepted"] and c["position"] == i for c in checks) for i in range(4)]
    assert (sum(totals.proposed_by_position) - before[2], sum(totals.accepted_by_position) - before[3]) == (
        totals.proposed - before[0], totals.accepted - before[1])


def test_a_failed_batch_leaves_the_by_position_counters_as_they_were():
    stats = SpecStats("draft", 3)
    stats.add(3, 1)
    saved = dict(vars(stats))  # what run_isolated keeps before a batched attempt
    stats.add(3, 2)
    vars(stats).update(saved)
    assert (stats.proposed_by_position, stats.accepted_by_position) == ([1, 1, 1], [1, 0, 0])


@pytest.mark.parametrize("params", [spec("draft"), spec("ngram"), spec("draft", temperature=0, seed=None)],
                         ids=["draft", "ngram", "greedy"])
def test_the_checks_change_no_token(llm, params, monkeypatch):
    with_checks = run(llm, params)
    monkeypatch.setattr(spec_decode, "draft_checks", lambda rows, drafts, q, tokens, greedy: [None] * len(tokens))
    without = run(llm, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].spec_marks) for o in with_checks] == [
        (o.outputs[0].token_ids, o.outputs[0].spec_marks) for o in without]
    assert all(c is None for o in without for c in o.outputs[0].drafts)


def test_seeded_tokens_are_the_same_whichever_proposer_drafted_them(llm):
    by_draft, by_ngram = run(llm, spec("draft")), run(llm, spec("ngram"))
    assert [o.outputs[0].token_ids for o in by_draft] == [o.outputs[0].token_ids for o in by_ngram]
