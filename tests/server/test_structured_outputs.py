"""Structured outputs through the OpenAI API, as the official `openai` client sends them, over a real replica:
response_format (json_object, json_schema) and vLLM's structured_outputs / guided_* extra fields, in every mode."""
import json
import math
import re
import sys

import jsonschema_rs
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"]}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture
def client(api):
    _, http = api
    return openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0)


def test_response_format_json_schema_gives_json_that_follows_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    # the tiny random model likes JSON's free whitespace (up to 24 characters a gap): room for it
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=160, n=6, temperature=1.0,
                                         seed=1, response_format=fmt)
    done = [c for c in out.choices if c.finish_reason == "stop"]
    assert len(done) >= 3
    for c in done:
        jsonschema_rs.validate(SCHEMA, json.loads(c.message.content))


# a number of any length, enums, a boolean, a bounded integer: no free-length string, which the tiny random model may
# fill up to max_tokens in any mode. Beam search maximises likelihood, and this model's likeliest tokens are JSON's free
# whitespace (up to 24 characters a gap): with more gaps (an array) no beam of width 3-4 ends within 160 tokens
# (docs/decoding.md)
SCHEMAS = {
    "enum+number": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                     "temperature": {"type": "number"}},
                    "required": ["unit", "temperature"]},
    "boolean+enum": SCHEMA,
    "integer+boolean": {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 10},
                                                         "done": {"type": "boolean"}}, "required": ["count", "done"]},
}
MODES = {"greedy": dict(temperature=0), "sample": dict(temperature=1.0, seed=5),
         "beam": dict(temperature=0, extra_body={"mode": "beam", "beam_width": 4}),
         "speculative": dict(temperature=0, extra_body={"mode": "speculative", "proposer": "ngram"})}


def load_json(text: str):
    """JSON allows any exponent, and the tiny model writes numbers such as 4.2e381333333333: a number beyond float's
    range reads as the largest float of its sign (json.loads would give inf, which a schema's "number" refuses)."""
    return json.loads(text, parse_float=lambda s: math.copysign(min(abs(float(s)), sys.float_info.max), float(s)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_gives_a_whole_document_that_follows_it_in_every_mode(client, name, mode):
    """Beam search too: a beam that ended the grammar wins over beams cut at max_tokens (docs/decoding.md)."""
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name.replace("+", "_"), "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "What is the temperature in Paris today? Answer in JSON."}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=160, response_format=fmt,
                                         **MODES[mode])
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema_rs.validate(schema, load_json(choice.message.content))


def test_response_format_json_object_on_completions_gives_a_json_object(client):
    # OpenAI's completions take no response_format; vLLM's (and ours) do, as an extra field
    out = client.completions.create(model="tiny", prompt="{", max_tokens=160, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    text = out.choices[0].text
    assert text.lstrip().startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_vllm_structured_outputs_and_guided_fields_constrain_every_mode(client):
    regex = r"[0-9]{3}-[a-z]{2}"
    bodies = {"greedy": {"temperature": 0}, "sample": {"temperature": 1.0, "seed": 3},
              "speculative": {"temperature": 0, "extra": {"mode": "speculative", "proposer": "ngram"}}}
    for name, kw in bodies.items():
        extra = {**kw.get("extra", {}), "structured_outputs": {"regex": regex}}
        out = client.completions.create(model="tiny", prompt="123-ab 456-cd", max_tokens=16,
                                        temperature=kw["temperature"], seed=kw.get("seed"), extra_body=extra)
        assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop", name
    out = client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=0, extra_body={
        "guided_regex": regex})
    assert re.fullmatch(regex, out.choices[0].text)
    out = client.completions.create(model="tiny", prompt="x", max_tokens=64, temperature=0, extra_body={
        "guided_json": SCHEMA})
    if out.choices[0].finish_reason == "stop":
        jsonschema_rs.validate(SCHEMA, json.loads(out.choices[0].text))


def test_guided_choice_with_beam_search_gives_a_choice_per_beam(client):
    choices = ["alpha", "beta", "gamma delta", "epsilon"]
    out = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=8, temperature=0, n=3,
                                    extra_body={"guided_choice": choices, "mode": "beam", "beam_width": 3})
    assert len(out.choices) == 3
    assert all(c.text in choices for c in out.choices)


def test_a_stream_under_a_grammar_streams_the_constrained_text(client):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"guided_regex": "(yes|no), [0-9]{2}"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch("(yes|no), [0-9]{2}", text)


@pytest.mark.parametrize("extra,mentions", [
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs: .*Unclosed"),
    ({"guided_json": '{"type": "objec'}, "structured_outputs: .*JSON"),
    ({"guided_choice": []}, "structured_outputs: choice must be a non-empty list"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "structured_outputs: give one way"),
    ({"response_format": {"type": "json_schema"}}, "json_schema needs a json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "structured_outputs: give one way"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs: give exactly one"),
])
def test_a_bad_grammar_is_a_clear_400(client, extra, mentions):
    with pytest.raises(openai.BadRequestError, match=mentions):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=extra)
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                        response_format={"type": "text"})
    assert ok.choices[0].finish_reason in ("length", "stop")
