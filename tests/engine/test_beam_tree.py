"""The beam tree (BeamSearch.events, RequestOutput.beam_events): replaying the events must rebuild exactly the
hypotheses the search returns, with the scores and log-probs it reports, and nothing the search dropped."""
import math

import pytest

from engine_service.engine.llm_engine import LLMEngine
from engine_service.engine.sampling_params import SamplingParams
from tests.engine.test_beam_search import beam_params, random_prompt


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, prompt, params)
    events, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                events += out.beam_events or []
                final = out
    return events, final


def replay(events: list[dict]) -> dict[int, dict]:
    nodes = {0: {"parent": None, "tokens": [], "kind": "root", "pruned": False}}
    for e in events:
        if e["kind"] == "prune":
            assert e["node"] in nodes and not nodes[e["node"]]["pruned"], e
            nodes[e["node"]]["pruned"] = True
            continue
        assert e["node"] not in nodes, f"node {e['node']} added twice"
        parent = nodes[e["parent"]]
        assert parent["kind"] in ("root", "fork"), "only live beams grow"
        assert len(parent["tokens"]) == e["step"], "a node at step s extends a parent with s tokens"
        nodes[e["node"]] = {**e, "tokens": parent["tokens"] + [e["token_id"]], "pruned": False}
    return nodes


@pytest.mark.parametrize("width,penalty,early", [(3, 1.0, False), (4, 0.5, True), (2, 2.0, "never")])
def test_replayed_tree_gives_the_returned_hypotheses(tiny_llama_dir, width, penalty, early):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=256, block_size=8)
    eos = engine.tokenizer.encode("e", add_special_tokens=False)  # a frequent token: hypotheses finish early
    params = beam_params(width, width, 12, penalty, early, eos=eos, logprobs=0)
    events, final = run(engine, "b", random_prompt(20, seed=3), params)
    nodes = replay(events)
    finished = [n for n in nodes.values() if n["kind"] == "finish" and not n["pruned"]]
    live = [n for n in nodes.values() if n["kind"] == "fork"]
    grew = {m.get("parent") for m in nodes.values()}
    assert all(n["pruned"] or nid in grew for nid, n in nodes.items() if n["kind"] == "fork"), \
        "every live beam either grew or was pruned by the end"
    outs = final.outputs
    assert sorted(tuple(n["tokens"]) for n in finished) == sorted(tuple(o.token_ids) for o in outs)
    for o in outs:
        node = next(n for n in finished if n["tokens"] == o.token_ids)
        assert node["score"] == pytest.approx(o.score, rel=1e-5)
        assert node["logprob"] == pytest.approx(o.logprobs[-1][o.token_ids[-1]], rel=1e-5)
        assert node["rank"] is not None
    for step in {n["step"] for n in live}:  # at most W live beams per step, ranked 0.. by summed score
        forks = sorted((n for n in live if n["step"] == step), key=lambda n: n["rank"])
        assert [n["rank"] for n in forks] == list(range(len(forks))) and len(forks) <= width
        assert all(a["score"] >= b["score"] for a, b in zip(forks, forks[1:]))
        for n in forks:  # a fork's score is its parent's plus its token's (processed = raw here) log-prob
            parent = nodes[n["parent"]]
            assert n["score"] == pytest.approx(parent.get("score", 0.0) + n["logprob"], abs=1e-4)


def test_forks_of_a_step_share_the_prompt_blocks(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=256, block_size=8)
    events, _ = run(engine, "b", random_prompt(30, seed=4), beam_params(4, 1, 6))
    first = [e for e in events if e["kind"] == "fork" and e["step"] == 0]
    assert len(first) == 4
    shared = set.intersection(*(set(e["blocks"]) for e in first))
    assert len(shared) >= 30 // 8  # the prompt's full blocks are held by every beam


def test_non_beam_requests_carry_no_tree(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64)
    events, final = run(engine, "g", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    assert events == [] and final.beam_events is None


def test_masked_mass_is_the_raw_probability_the_grammar_forbids(tiny_llama_dir):
    """Checked against HF's logits and a fresh xgrammar matcher, in all four modes."""
    import torch
    import xgrammar as xgr

    from engine_service.engine.sampling_params import StructuredOutputsParams
    from tests.hf_oracle import hf_model

    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=256, block_size=8)
    spec = StructuredOutputsParams(regex="[ab]{2}(c|de)[0-9]")
    prompt = engine.tokenizer.encode("abc de ab 12 ba", add_special_tokens=False)
    runs = {"greedy": SamplingParams(temperature=0, max_tokens=8, logprobs=1, structured_outputs=spec),
            "sample": SamplingParams(temperature=1.0, seed=1, max_tokens=8, logprobs=1, structured_outputs=spec),
            "beam": beam_params(3, 2, 8, logprobs=1, structured_outputs=spec),
            "speculative": SamplingParams(temperature=1.0, seed=2, max_tokens=8, logprobs=1, structured_outputs=spec,
                                          mode="speculative", proposer="ngram", num_speculative_tokens=3)}
    model = hf_model(str(tiny_llama_dir))
    bitmask = xgr.allocate_token_bitmask(1, engine.vocab_size)
    checked = 0
    for name, params in runs.items():
        _, final = run(engine, name, prompt, params)
        compiled = engine._structured.compiled(spec)
        for out in final.outputs:
            assert out.masked is not None and len(out.masked) == len(out.token_ids)
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:]
            matcher = xgr.GrammarMatcher(compiled)
            for t, token in enumerate(out.token_ids):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask)
                row = logits[t:t + 1].log_softmax(-1)
                kept = row.clone()
                xgr.apply_token_bitmask_inplace(kept, bitmask)
                expect = 1.0 - math.exp(float(kept.logsumexp(-1)))
                assert out.masked[t] == pytest.approx(expect, abs=2e-4), (name, t)
                assert matcher.accept_token(token)
                checked += 1
    assert checked >= 16


def test_no_masked_mass_without_a_grammar_or_without_logprobs(tiny_llama_dir):
    from engine_service.engine.sampling_params import StructuredOutputsParams

    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64)
    _, plain = run(engine, "a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, logprobs=1))
    _, quiet = run(engine, "b", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3,
                                                         structured_outputs=StructuredOutputsParams(regex="[ab]+")))
    assert plain.outputs[0].masked is None and quiet.outputs[0].masked is None
