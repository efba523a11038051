"""Structured outputs (engine/structured.py): every output follows its grammar, in all four decoding modes.

The SmolLM2 cases batch 20 JSON schemas and 10 regexes per mode. A run that ends ("stop") must match in full
(json + jsonschema_rs, re.fullmatch); one cut at max_tokens must be a prefix the grammar accepts token by token.
"""
import json
import math
import re
import sys

import jsonschema_rs
import pytest
import torch
import xgrammar as xgr

from engine_service.engine.llm import LLM
from engine_service.engine.llm_engine import LLMEngine
from engine_service.engine.proposers import Proposal
from engine_service.engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine_service.engine.structured import GrammarState, StructuredDecoding, build_grammar, masks

S = StructuredOutputsParams
inf = float("inf")
STR = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": STR, "country": STR}, "required": ["city", "country"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": STR, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                      "y": {"type": "integer", "minimum": -50, "maximum": 50}}, "required": ["x", "y"]},
    {"type": "object", "properties": {"title": STR, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"enum": ["low", "high"]}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}}, "required": ["id"]},
    {"type": "object", "properties": {"first": STR, "last": STR}, "required": ["first", "last"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "lat": {"type": "integer", "minimum": -90, "maximum": 90}, "lon": {"type": "integer", "minimum": -180,
                                                                        "maximum": 180}},
        "required": ["lat", "lon"]}}, "required": ["point"]},
    {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}, "maxItems": 4}},
     "required": ["numbers"]},
    {"type": "object", "properties": {"language": {"enum": ["python", "rust", "go"]}, "typed": {"type": "boolean"}},
     "required": ["language", "typed"]},
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["word"]},
    {"type": "object", "properties": {"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 100}},
     "required": ["value"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                           "maximum": 10}},
     "required": ["status", "count"]},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "name": STR}, "required": ["pet", "name"]},
    {"type": "object", "properties": {"valid": {"type": "boolean"}, "reason": STR}, "required": ["valid", "reason"]},
    {"type": "object", "properties": {"animal": STR, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
     "required": ["animal", "legs"]},
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"[A-Z][a-z]{1,8}", r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
           r"[a-z]+@[a-z]+\.(com|org)", r"#[0-9a-f]{6}", r"(red|green|blue) (car|bike)", r"[0-9]+(\.[0-9]{1,2})?",
           r"[A-Z]{2}[0-9]{2}", r"(true|false)"]
SPECS = [S(json=s, disable_any_whitespace=True) for s in SCHEMAS] + [S(regex=r) for r in REGEXES]
ASKS = ["Give a JSON answer." if s.json is not None else "Answer briefly." for s in SPECS]
MODES = {
    "greedy": dict(temperature=0),
    "sample": dict(mode="sample", temperature=0.8, seed=7),
    "beam": dict(mode="beam", temperature=0, beam_width=2, n=2),
    "speculative": dict(mode="speculative", proposer="ngram", num_speculative_tokens=3, temperature=0.8, seed=3),
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return LLM(str(smollm2_dir), num_kv_blocks=1024)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=512)


_RUNS: dict[str, list] = {}  # mode -> outputs: the greedy run serves two tests


def run_mode(llm: LLM, mode: str) -> list:
    if mode not in _RUNS:
        prompts = [llm.apply_chat_template([{"role": "user", "content": ask}]) for ask in ASKS]
        params = [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=spec, **MODES[mode]) for spec in SPECS]
        _RUNS[mode] = llm.generate(prompts, params)
    return _RUNS[mode]


def check(spec: S, text: str, finish_reason: str, token_ids: list[int], grammars: StructuredDecoding) -> bool:
    """True when the output ended and matches in full; a cut output must be a prefix the grammar accepts."""
    matcher = xgr.GrammarMatcher(grammars.compiled(spec))
    assert all(matcher.accept_token(t) for t in token_ids), f"{text!r}: a token the grammar refuses"
    if finish_reason != "stop":
        return False
    if spec.json is not None:
        jsonschema_rs.validate(spec.json, json.loads(text))
    else:
        assert re.fullmatch(spec.regex, text), f"{text!r} does not match {spec.regex}"
    return True


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_output_follows_its_grammar(smollm2, mode):
    outs = run_mode(smollm2, mode)
    grammars = smollm2.engine._structured
    complete = [check(spec, o.text, o.finish_reason, o.token_ids, grammars)
                for spec, out in zip(SPECS, outs) for o in out.outputs]
    print(f"{mode}: {sum(complete)} of {len(complete)} outputs ended within {MAX_TOKENS} tokens")
    assert sum(complete) >= 0.7 * len(complete), f"{mode}: only {sum(complete)} of {len(complete)} completed"


@pytest.mark.slow
def test_greedy_speculation_under_a_grammar_gives_the_constrained_greedy_tokens(smollm2):
    prompts = [smollm2.apply_chat_template([{"role": "user", "content": ask}]) for ask in ASKS]
    greedy = run_mode(smollm2, "greedy")
    spec = smollm2.generate(prompts, [SamplingParams(mode="speculative", proposer="ngram", temperature=0,
                                                     max_tokens=MAX_TOKENS, structured_outputs=s) for s in SPECS])
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in greedy]
    assert sum(o.metrics.spec["accepted"] for o in spec) > 0  # drafts were verified under the masks, some kept


@pytest.mark.slow
def test_each_beam_keeps_its_own_grammar_state(smollm2):
    choices = ["red apple", "green pear", "blue berry", "yellow banana", "purple plum"]
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Name a fruit with its colour."}])
    out = smollm2.generate(prompt, SamplingParams(mode="beam", beam_width=4, n=4, temperature=0, max_tokens=12,
                                                  structured_outputs=S(choice=choices)))[0]
    assert len(out.outputs) == 4
    for o in out.outputs:
        assert o.text in choices and o.finish_reason == "stop"


# ---- beam search under a grammar: a beam that ends the grammar wins over outputs cut at max_tokens

ENUM_NUMBER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                "temperature": {"type": "number"}}, "required": ["unit", "temperature"]}
EOS, DIGIT, CLOSE = 0, 1, 2  # the toy vocabulary of the BeamSearch cases: stop token, a digit, "}"


def load_json(text: str):
    """JSON allows any exponent, and a small model writes numbers such as 4.2e381333333333: a number beyond float's
    range reads as the largest float of its sign (json.loads would give inf, which a schema's "number" refuses)."""
    return json.loads(text, parse_float=lambda s: math.copysign(min(abs(float(s)), sys.float_info.max), float(s)))


def toy_search(constrained: bool, max_tokens: int = 3):
    """A width-2 BeamSearch over a 4-token toy vocabulary, driven without a model: `step(rows)` gives each live beam
    its log-probs as a grammar would mask them (a digit may always follow; after "}" only the stop token, which the
    model finds unlikely: -9) and runs one search step."""
    from engine_service.engine.beam import BeamSearch
    from engine_service.engine.sequence import Request, Sequence

    spec = S(regex="[0-9]*}") if constrained else None
    req = Request("toy", None, [7], SamplingParams(mode="beam", beam_width=2, n=2, temperature=0,
                                                   max_tokens=max_tokens, structured_outputs=spec))
    search = BeamSearch(req, {EOS})
    ids = iter(range(1, 100))
    req.seqs = [Sequence(next(ids), req, [7])]

    def row(seq: Sequence) -> torch.Tensor:
        if seq.output_token_ids[-1:] == [CLOSE]:
            return torch.tensor([-9.0, -inf, -inf, -inf])
        return torch.tensor([-inf, -0.1, -2.5, -inf])

    def step():
        for seq in req.seqs:
            r = row(seq)
            search.pending[seq.seq_id] = (r, r, None)
        search.step(req, lambda parent: Sequence(next(ids), req, list(parent.token_ids)), lambda seq: None)
    return search, step


def test_a_beam_whose_grammar_can_only_stop_ends_though_its_stop_token_is_not_among_the_top_w():
    search, step = toy_search(constrained=True)
    step()  # live: [digit], ["}"]
    step()  # "}" then its stop token (-11.5) is no top-2 candidate: HF would drop the beam, we keep its ending
    assert [(h.token_ids, h.finish_reason) for h in search.finished] == [([CLOSE, EOS], "stop")]
    assert search.finished[0].score == pytest.approx((-2.5 - 9.0) / 2)


def test_under_a_grammar_finished_documents_rank_above_likelier_outputs_cut_at_max_tokens():
    search, step = toy_search(constrained=True)
    for _ in range(3):
        step()
    assert search.done
    assert [(h.token_ids, h.finish_reason) for h in search.finished] == [
        ([DIGIT, CLOSE, EOS], "stop"), ([CLOSE, EOS], "stop")]  # not [digit x3] (-0.1) nor [digit, digit, "}"]


def test_without_a_grammar_beam_search_keeps_hf_rules():
    search, step = toy_search(constrained=False)
    for _ in range(3):
        step()
    assert [(h.token_ids, h.finish_reason) for h in search.finished] == [
        ([DIGIT, DIGIT, DIGIT], "length"), ([DIGIT, DIGIT, CLOSE], "length")]


@pytest.mark.parametrize("mode", ["sample", "speculative", "beam"])
@pytest.mark.parametrize("penalty", [5e-324, 1e300])
def test_an_extreme_repetition_penalty_under_a_grammar_still_draws_what_the_grammar_allows(tiny_llm, mode, penalty):
    """Found by the API fuzz test (session 36): repetition_penalty 5e-324 (0 in float32) made a seen logit +inf,
    the draw NaN, and the drawn token one the grammar refused: an engine error for that request."""
    extra = dict(beam_width=2) if mode == "beam" else {}
    for temperature in (1.0, 0.0):
        out = tiny_llm.generate("\u00dc\u00cd\u00f0W\u00a9\u00fa+4 eu", SamplingParams(
            mode=mode, temperature=temperature, repetition_penalty=penalty, max_tokens=24, **extra,
            structured_outputs=S(json_object=True)))[0]
        assert out.error is None
        for o in out.outputs:
            assert o.finish_reason in ("stop", "length"), o
            if o.finish_reason == "stop":
                assert isinstance(load_json(o.text), dict), o.text


@pytest.mark.parametrize("width", [2, 3, 4, 8])
def test_beam_search_under_a_json_schema_returns_whole_documents(tiny_llm, width):
    """The tiny random model writes long numbers; before the rule above, widths 3, 4, 6 and 8 returned outputs cut
    mid-number at max_tokens (invalid JSON), as the OpenAI API did."""
    llm = tiny_llm
    messages = [{"role": "user", "content": "What is the temperature in Paris today? Answer in JSON."}]
    out = llm.chat(messages, SamplingParams(mode="beam", beam_width=width, n=width, temperature=1.0, max_tokens=160,
                                            structured_outputs=S(json=ENUM_NUMBER)))[0]
    assert len(out.outputs) == width
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema_rs.validate(ENUM_NUMBER, load_json(o.text))


@pytest.mark.slow
def test_smollm2_beam_search_under_json_schemas_returns_whole_documents(smollm2):
    schemas = [ENUM_NUMBER, {"type": "object", "properties": {"name": STR, "price": {"type": "number"}},
                             "required": ["name", "price"]}]
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Answer in JSON."}])
    for schema in schemas:
        out = smollm2.generate(prompt, SamplingParams(mode="beam", beam_width=4, n=4, temperature=0, max_tokens=160,
                                                      structured_outputs=S(json=schema)))[0]
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text
            jsonschema_rs.validate(schema, load_json(o.text))


def test_forked_beams_get_independent_matchers(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64)
    engine.add_request("b", [5, 6, 7], SamplingParams(mode="beam", beam_width=3, n=3, temperature=0, max_tokens=6,
                                                      structured_outputs=S(regex="[ab]{3}c")))
    seen_fork = False
    while engine.has_unfinished():
        engine.step()
        req = engine.requests.get("b")
        if req is not None and len(req.seqs) > 1:
            seen_fork = True
            assert len({id(s.grammar.matcher) for s in req.seqs}) == len(req.seqs)
            assert all(s.grammar.num_accepted == s.num_output_tokens for s in req.seqs)
    assert seen_fork


def test_parallel_samples_each_follow_the_grammar(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    out = llm.generate("x", SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=12,
                                           structured_outputs=S(regex="(cat|dog|bird)s?")))[0]
    assert len(out.outputs) == 4
    for o in out.outputs:
        assert re.fullmatch("(cat|dog|bird)s?", o.text) and o.finish_reason == "stop"


def test_draft_model_speculation_under_a_grammar_gives_the_constrained_greedy_tokens(tiny_llama_dir, tmp_path):
    from tests.engine.test_spec_decode import save_draft

    draft = save_draft(tiny_llama_dir, tmp_path / "draft", noise=0.02)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, draft_model=str(draft))
    specs = [S(regex="[a-f0-9]{4}-[a-z]{3}"), S(json={"type": "array", "items": {"enum": ["x", "yy"]},
                                                      "maxItems": 4}, disable_any_whitespace=True)]
    for spec in specs:
        greedy = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec))[0]
        out = llm.generate("abc", SamplingParams(mode="speculative", proposer="draft", num_speculative_tokens=3,
                                                 temperature=0, max_tokens=20, structured_outputs=spec))[0]
        assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
        assert out.metrics.spec["accepted"] > 0


def test_drafts_the_grammar_refuses_are_cut_when_proposed(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64)
    engine.add_request("s", "abc abc", SamplingParams(mode="speculative", proposer="ngram", temperature=0,
                                                      max_tokens=10, structured_outputs=S(regex="[0-9]{6}")))
    engine.step()  # the prefill and the first (digit) token
    (seq,) = engine.requests["s"].seqs
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)
    engine.spec._attach(seq, Proposal(encode("abc"), None))
    assert seq.num_draft_tokens == 0
    digits, letters = encode("12"), encode("x")
    engine.spec._attach(seq, Proposal(digits + letters + digits, None))
    assert seq.num_draft_tokens == len(digits) and seq.token_ids[-len(digits):] == digits


def test_speculation_with_ngram_drafts_keeps_outputs_valid(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    prompt = "12 34 12 34 12 34 abc abc abc"  # digits to copy among letters the grammar refuses
    for seed in range(4):
        out = llm.generate(prompt, SamplingParams(mode="speculative", proposer="ngram", temperature=1.0, seed=seed,
                                                  max_tokens=12, structured_outputs=S(regex="[0-9 ]{1,8}x")))[0]
        text = out.outputs[0].text
        assert re.fullmatch("[0-9 ]{1,8}x", text) if out.outputs[0].finish_reason == "stop" else \
            re.fullmatch("[0-9 ]{0,8}", text), text


def test_masks_over_drafts_roll_the_matcher_back(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64)
    state = engine._grammar(SamplingParams(structured_outputs=S(regex="(ab)+c")))
    ids = engine.tokenizer.encode("ababab", add_special_tokens=False)
    rows = [(state, ids[:j]) for j in range(len(ids) + 1)]  # verification rows: the prefix + drafts[:j]
    before = masks([(state, [])], engine.vocab_size).bitmask[0].clone()
    mask = masks(rows, engine.vocab_size)
    assert mask.rows == list(range(len(rows))) and state.num_accepted == 0
    assert (masks([(state, [])], engine.vocab_size).bitmask[0] == before).all()  # back at the start
    assert (mask.bitmask[0] == before).all()


def test_drafts_past_the_grammars_end_are_offered_to_no_matcher(tiny_llama_dir, capfd):
    """A drafter goes on drafting after a draft that ends the grammar; every token offered to a matcher past its end
    printed xgrammar's warning on stderr (a replica's log, per draft, found by the request-mix fuzz, session 37)."""
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64)
    state = engine._grammar(SamplingParams(structured_outputs=S(choice=["ab"])))
    ids = engine.tokenizer.encode("ab", add_special_tokens=False)
    eos = sorted(engine.eos_token_ids)[0]
    after = ids + [eos, ids[0], ids[0]]
    assert state.valid_prefix([], after) == ids + [eos]
    mask = masks([(state, after[:j]) for j in range(len(after) + 1)], engine.vocab_size)
    assert mask.rows == list(range(len(ids) + 1))  # the rows past the end are left unconstrained
    assert state.num_accepted == 0 and "terminated" not in capfd.readouterr().err


def test_the_matcher_ends_the_output_even_when_eos_is_ignored(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                           structured_outputs=S(choice=["hello", "world"])))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("hello", "world")


@pytest.mark.parametrize("mode", ["greedy", "sample", "speculative", "beam"])
def test_stop_token_ids_stop_the_output_without_taking_a_token_from_the_grammar(tiny_llama_dir, mode):
    """Found by an in-process fuzz of request mixes (session 37): stop_token_ids were the matcher's stop tokens, so
    under `root ::= "x" ...` stop_token_ids=[id of "x"] left no token allowed at the start; the greedy and
    speculative draws from nothing raised out of the step (failing every request in it), the sampled one failed
    its request. Now they stop the output where drawn, as without a grammar, and the batch beside goes on."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    tok = llm.engine.tokenizer
    x, z = tok.convert_tokens_to_ids(["x", "z"])
    grammar = S(grammar='root ::= "x" ("y" | "z")*')
    extra = dict(beam_width=2) if mode == "beam" else dict(temperature=0.0) if mode == "greedy" else dict(seed=1)
    beside = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([[5, 6, 7, 5, 6, 7], [5, 6, 7, 5, 6, 7], [9, 10, 11]], [
        SamplingParams(mode=mode, max_tokens=8, stop_token_ids=[x], structured_outputs=grammar, **extra),
        SamplingParams(mode=mode, max_tokens=8, stop_token_ids=[z], structured_outputs=grammar, **extra), beside])
    assert all(out.error is None for out in outs)
    first = outs[0].outputs[0]
    assert (first.token_ids, first.text, first.finish_reason) == ([x], "", "stop")  # "x" drawn: a stop token
    for o in outs[1].outputs:
        assert o.token_ids[0] == x and z not in o.token_ids[:-1]
        assert (o.finish_reason, o.text) == (("stop", tok.decode(o.token_ids[:-1])) if o.token_ids[-1] == z
                                             else ("length", tok.decode(o.token_ids)))
    assert outs[2].outputs[0].token_ids == llm.generate([[9, 10, 11]], beside)[0].outputs[0].token_ids


def test_beam_search_returns_fewer_than_n_where_the_grammar_allows_fewer(tiny_llm):
    """No -inf beams the grammar refuses to fill the n (HF's beams would be): a JSON object's first token is "{"."""
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(mode="beam", beam_width=4, n=4, max_tokens=1,
                                                        structured_outputs=S(json_object=True)))[0]
    assert out.error is None and [(o.text, o.finish_reason) for o in out.outputs] == [("{", "length")]
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(mode="beam", beam_width=4, n=4, max_tokens=2,
                                                        structured_outputs=S(json_object=True)))[0]
    assert len(out.outputs) == 4 and all(o.text.startswith("{") for o in out.outputs)


def test_a_grammar_the_vocabulary_cannot_spell_is_a_value_error_of_its_row():
    """A row whose grammar allows no token at all (a character no token spells) raises ValueError naming
    structured_outputs, which run_isolated pins on its request (isolation.py), instead of a draw from nothing;
    xgrammar may leave the bits past the vocabulary set, which allow nothing."""
    info = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info)
    spelled = GrammarState(xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_ebnf('root ::= "a" "b"'))))
    unspelled = GrammarState(xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_ebnf('root ::= "c"'))))
    assert masks([(None, []), (spelled, [])], 3).rows == [1]
    with pytest.raises(ValueError, match="^structured_outputs: the grammar allows no token"):
        masks([(spelled, []), (unspelled, [])], 3)
    assert masks([(spelled, [0, 1])], 3).bitmask[0, 0] & 0b111 == 0b100  # after "ab": only the stop token
    assert spelled.num_accepted == 0  # the rows' tokens rolled back


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 3, "maxLength": 5},
    {"type": "object", "required": ["s", "t"],
     "properties": {"s": {"type": "string", "maxLength": 6}, "t": {"type": "string", "minLength": 2, "maxLength": 8}}}])
def test_length_bounded_strings_hold_no_raw_control_characters(tiny_llm, schema):
    """xgrammar 0.2.8 compiles minLength / maxLength to a repetition that admits raw control characters, which JSON
    forbids (mlc-ai/xgrammar#800): the tiny model sampled `" 42\x1d..."`, finished "stop", that json.loads refused
    (found by sampling it under 25 schemas, session 37). build_grammar hands xgrammar such bounds as a pattern."""
    outs = tiny_llm.generate([[5, 6, 7]], SamplingParams(mode="sample", n=24, temperature=1.5, seed=1, max_tokens=80,
                                                         structured_outputs=S(json=schema,
                                                                              disable_any_whitespace=True)))[0].outputs
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= 12
    for o in done:
        value = json.loads(o.text)  # strict: no control character in a string
        if "\ufffd" not in o.text:  # (xgrammar also takes an overlong UTF-8 sequence as one character, which
            jsonschema_rs.validate(schema, value)  # decodes to three U+FFFD: a random model's bytes, left alone)


@pytest.mark.parametrize("schema,keyword", [
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}, "allOf"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "if"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "string"}}, "contains"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
])
def test_a_schema_keyword_the_grammar_cannot_enforce_is_refused(schema, keyword):
    """xgrammar 0.2.8 compiles these to no constraint at all (under the two-schema allOf above the tiny model wrote a
    bare number, finish_reason "stop"; found by sampling it under 25 schemas, session 37). vLLM refuses them where
    xgrammar is its only backend; so does build_grammar (the API's 400), rather than return what the schema rejects."""
    with pytest.raises(ValueError, match=f"^structured_outputs: json: '{keyword}' \\(at \\$\\) is not supported"):
        build_grammar(S(json=schema))
    # what it enforces stays: a one-schema allOf (a $ref with a description, as pydantic writes it), keyword names
    build_grammar(S(json={"type": "object", "$defs": {"X": {"type": "integer"}},
                          "properties": {"not": {"allOf": [{"$ref": "#/$defs/X"}]}, "if": {"type": "string"}}}))


def test_compiled_grammars_are_cached_per_distinct_spec(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64)
    for spec in (S(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
                 S(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'), S(regex="a+")):
        engine._grammar(SamplingParams(structured_outputs=spec))
        engine._grammar(SamplingParams(structured_outputs=spec))
    assert engine._structured.num_compiled == 2


@pytest.mark.parametrize("spec,why", [
    (dict(json='{"type": "objec'), "structured_outputs: .*JSON"),
    (dict(json={"type": "nonsense"}), "structured_outputs: .*nonsense"),
    (dict(regex="(["), "structured_outputs: .*Unclosed"),
    (dict(choice=[]), "structured_outputs: choice must be a non-empty list"),
    (dict(), "structured_outputs: give exactly one"),
    (dict(regex="a", choice=["a"]), "structured_outputs: give exactly one"),
    (dict(grammar="root ::= "), "structured_outputs: .*EBNF"),
    (dict(jsn={}), "structured_outputs: .*jsn"),
])
def test_user_errors_are_value_errors_naming_structured_outputs(tiny_llama_dir, spec, why):
    with pytest.raises(ValueError, match=why):
        build_grammar(SamplingParams(structured_outputs=spec).structured_outputs)


def test_a_bad_grammar_is_refused_at_add_request_and_the_engine_goes_on(tiny_llama_dir):
    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=64)
    with pytest.raises(ValueError, match="^structured_outputs: "):
        engine.add_request("bad", "x", SamplingParams(structured_outputs={"regex": "(["}))
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="^min_tokens: "):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})


@pytest.mark.parametrize("mode", ["sample", "speculative"])
def test_constrained_sampling_follows_the_masked_distribution(tiny_llama_dir, mode):
    """Each token is a draw from the model's distribution renormalised over what the grammar allows (checked by
    randomized PIT against HF's logits and a fresh xgrammar matcher); speculative verification with n-gram drafts
    included."""

    from tests.engine.test_spec_sampling import uniform_p
    from tests.hf_oracle import hf_model

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=512, block_size=8)
    spec = S(regex="[ab]{6}")
    prompt = llm.engine.tokenizer.encode("ababab abab ababab abab ab", add_special_tokens=False)
    extra = dict(mode="speculative", proposer="ngram", num_speculative_tokens=2) if mode == "speculative" else {}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, structured_outputs=spec, **extra)
              for s in range(150)]
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": prompt}] * len(params), params)]
    if mode == "speculative":
        assert sum(m == "accepted" for o in outs for m in o.spec_marks) > 50  # drafts were kept under the mask
    model, compiled = hf_model(str(tiny_llama_dir)), llm.engine._structured.compiled(spec)
    gen, us = torch.Generator().manual_seed(5), []
    bitmask = xgr.allocate_token_bitmask(1, llm.engine.vocab_size)
    for o in outs:
        tokens = [t for t in o.token_ids if t not in llm.engine.eos_token_ids]
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:]
        matcher = xgr.GrammarMatcher(compiled)
        for t, token in enumerate(tokens):
            matcher.fill_next_token_bitmask(bitmask)
            row = logits[t:t + 1].clone()
            xgr.apply_token_bitmask_inplace(row, bitmask)
            p = row[0].softmax(-1)
            assert p[token] > 0 and matcher.accept_token(token)
            above = torch.where(p > p[token], p, 0.0).sum()
            us.append(float(above + torch.rand((), generator=gen, dtype=p.dtype) * p[token]))
    assert len(us) > 300 and uniform_p(torch.tensor(us).clamp(0, 1)) > 1e-3
