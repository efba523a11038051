"""Stops, as vLLM has them: a stop string or stop token ends the output and leaves the text (unless
include_stop_str_in_output), and no text a running request reports is ever taken back, even when a
stop string spans several tokens."""
import os
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_service import LLM, SamplingParams
from shared.openai_schema import ChatBody, CompletionBody
from shared.protocol import GenerationRequest, SamplingOptions, decode_request, encode

THREADS = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
PROMPT = "Once upon a time"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, num_threads=THREADS)


@pytest.fixture(scope="module")
def greedy_ref(llm):
    """The unconstrained greedy output: the random model's text is arbitrary, so stops are picked from it."""
    return llm.generate(PROMPT, GREEDY)[0].outputs[0]


def stream(llm, params: SamplingParams, prompt: str = PROMPT) -> list:
    """Every CompletionOutput the engine reports for one request, step by step (the last one final)."""
    engine = llm.engine
    engine.add_request("stream", prompt, params)
    seen = []
    while engine.has_unfinished():
        seen += [out.outputs[0] for out in engine.step() if out.request_id == "stream"]
    return seen


def token_texts(llm, ids: list[int]) -> list[str]:
    return [llm.tokenizer.decode([t]) for t in ids]


def spanning_stop(llm, ref) -> str:
    """A stop string that starts inside one token and ends inside the token two further on."""
    texts = token_texts(llm, ref.token_ids)
    for j in range(len(texts) - 2):
        a, b, c = texts[j:j + 3]
        if len(a) >= 2 and len(c) >= 2 and (a + b + c).isascii() and (a + b + c).isprintable():
            stop = a[1:] + b + c[:1]
            if ref.text.find(stop) == len("".join(texts[:j])) + 1:
                return stop
    raise AssertionError(f"no ASCII run of three tokens in {ref.text!r}")


# ---- stop strings while streaming

def test_a_stop_string_spanning_tokens_never_shows_in_the_reported_text(llm, greedy_ref):
    stop = spanning_stop(llm, greedy_ref)
    seen = stream(llm, replace(GREEDY, stop=[stop]))
    final = seen[-1]
    assert (final.text, final.finish_reason) == (greedy_ref.text[:greedy_ref.text.find(stop)], "stop")
    for out in seen:
        assert final.text.startswith(out.text), f"{out.text!r} was reported, the final text is {final.text!r}"


@settings(max_examples=25, deadline=None)
@given(data=st.data(), include=st.booleans())
def test_every_reported_text_is_a_prefix_of_the_final_text(llm, greedy_ref, data, include):
    full = greedy_ref.text
    stops = []
    for _ in range(data.draw(st.integers(1, 2), label="stops")):
        start = data.draw(st.integers(0, len(full) - 1), label="start")
        stops.append(full[start:start + data.draw(st.integers(1, 6), label="length")])
    seen = stream(llm, replace(GREEDY, stop=stops, include_stop_str_in_output=include))
    final = seen[-1].text
    for out in seen:
        assert final.startswith(out.text)
    # the stop that completes first, as if the text came one character at a time (every stop is in `full`)
    end, at = min((full.find(s) + len(s), full.find(s)) for s in stops)
    assert final == full[:end if include else at]


def test_a_stop_string_that_never_appears_leaves_the_whole_text(llm, greedy_ref):
    final = stream(llm, replace(GREEDY, stop=["never appears in it"]))[-1]
    assert (final.text, final.token_ids, final.finish_reason) == (greedy_ref.text, greedy_ref.token_ids, "length")


# ---- include_stop_str_in_output

def test_include_stop_str_in_output_keeps_the_stop_string(llm, greedy_ref):
    stop = spanning_stop(llm, greedy_ref)
    out = stream(llm, replace(GREEDY, stop=[stop], include_stop_str_in_output=True))[-1]
    at = greedy_ref.text.find(stop)
    assert (out.text, out.finish_reason) == (greedy_ref.text[:at + len(stop)], "stop")


def printable_stop_token(llm, ref) -> int:
    """The position of a generated token with visible text that did not occur before it."""
    texts = token_texts(llm, ref.token_ids)
    return next(j for j in range(2, len(ref.token_ids)) if ref.token_ids[j] not in ref.token_ids[:j]
                and texts[j].strip() and texts[j].isascii() and texts[j].isprintable())


@pytest.mark.parametrize("mode", ["greedy", "speculative"])
def test_the_text_of_a_stop_token_is_dropped(llm, greedy_ref, mode):
    j = printable_stop_token(llm, greedy_ref)
    stop_id = greedy_ref.token_ids[j]
    out = stream(llm, replace(GREEDY, mode=mode, stop_token_ids=[stop_id]))[-1]
    before = llm.generate(PROMPT, replace(GREEDY, max_tokens=j))[0].outputs[0].text
    assert (out.token_ids, out.finish_reason) == (greedy_ref.token_ids[:j + 1], "stop")
    assert out.text == before


def test_include_stop_str_in_output_keeps_the_stop_tokens_text(llm, greedy_ref):
    j = printable_stop_token(llm, greedy_ref)
    params = replace(GREEDY, stop_token_ids=[greedy_ref.token_ids[j]], include_stop_str_in_output=True)
    out = stream(llm, params)[-1]
    assert out.text == llm.generate(PROMPT, replace(GREEDY, max_tokens=j + 1))[0].outputs[0].text


def test_a_finished_beam_drops_its_stop_tokens_text(llm, greedy_ref):
    j = printable_stop_token(llm, greedy_ref)
    stop_id = greedy_ref.token_ids[j]
    params = SamplingParams(mode="beam", beam_width=2, temperature=0, max_tokens=24, ignore_eos=True,
                            stop_token_ids=[stop_id])
    outs = llm.generate(PROMPT, params)[0].outputs
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "no beam ended with the stop token"
    for o in stopped:
        assert o.token_ids[-1] == stop_id
        assert o.text == llm.tokenizer.decode(o.token_ids[:-1], skip_special_tokens=True)


# ---- the flag travels through the protocol

def test_include_stop_str_in_output_travels_from_the_protocol_to_the_engine():
    req = GenerationRequest(prompt="hi", params=SamplingOptions(stop=["x"], include_stop_str_in_output=True))
    params = SamplingParams(**decode_request(encode(req)).params.model_dump())
    assert params.include_stop_str_in_output is True
    assert SamplingParams(**SamplingOptions().model_dump()).include_stop_str_in_output is False


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_the_openai_bodies_carry_include_stop_str_in_output(kind):
    if kind == "completion":
        req = CompletionBody(model="m", prompt="hi", include_stop_str_in_output=True).to_request()
    else:
        req = ChatBody(model="m", messages=[{"role": "user", "content": "hi"}],
                       include_stop_str_in_output=True).to_request(16)
    assert req.params.include_stop_str_in_output is True
