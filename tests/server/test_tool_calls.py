"""Tool calling through the OpenAI API, as the official `openai` client sends it, over a real replica: a named
function and tool_choice "required" come out of the tools' schemas (streamed and not), "auto" is refused (no parser
of the model's own format), and tools and earlier calls reach the chat template (shared/openai_tools.py)."""
import json

import jsonschema_rs
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.openai_tools import ToolCalls, ToolCallStream
from shared.protocol import ChatMessage, GenerationRequest, ToolCall, ToolCallFunction
from shared.routing import chat_prompt

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time"}}]  # no parameters: takes none
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}, "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def client(api):
    _, http = api
    return openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0)


def _streamed(client, **kw) -> tuple[list[dict], set[str]]:
    """The tool calls a stream sent, joined per call index as a client joins them, and its finish reasons."""
    calls: dict[int, dict] = {}
    finishes = set()
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            assert not choice.delta.content
            for entry in choice.delta.tool_calls or ():
                call = calls.setdefault(entry.index, {"id": entry.id, "name": entry.function.name, "arguments": ""})
                assert entry.id in (None, call["id"]) and entry.function.name in (None, call["name"])
                call["arguments"] += entry.function.arguments or ""
            if choice.finish_reason:
                finishes.add(choice.finish_reason)
    return [calls[i] for i in sorted(calls)], finishes


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=GET_WEATHER, max_tokens=120, temperature=0)
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice  # OpenAI's finish_reason for a forced function
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema_rs.validate(WEATHER, json.loads(call.function.arguments))
    # streamed: the same arguments in pieces, the id and name in the first entry
    (streamed,), finishes = _streamed(client, **kw)
    assert streamed["name"] == "get_weather" and streamed["arguments"] == call.function.arguments
    assert finishes == {"stop"}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_makes_calls_to_the_given_tools_streamed_as_not(client, parallel):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0,
              parallel_tool_calls=parallel)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        jsonschema_rs.validate(SCHEMAS[call.function.name], json.loads(call.function.arguments))
    streamed, finishes = _streamed(client, **kw)
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert finishes == {"tool_calls"} and len({c["id"] for c in streamed}) == len(streamed)


def test_sampled_choices_each_call_the_named_function(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=GET_WEATHER,
                                         max_tokens=120, temperature=1.0, seed=3, n=3)
    for choice in out.choices:
        if choice.finish_reason == "stop":
            jsonschema_rs.validate(WEATHER, json.loads(choice.message.tool_calls[0].function.arguments))


def test_tool_choice_none_answers_text(client):
    choice = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                            max_tokens=5, temperature=0).choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)


@pytest.mark.parametrize("kw,mentions", [
    (dict(tools=TOOLS), "tool_choice 'auto'"),  # the default with tools: needs a parser this server lacks
    (dict(tools=TOOLS, tool_choice="auto"), "needs a parser"),
    (dict(tool_choice="required"), "needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "no tool named 'nope'"),
    (dict(tools=[TOOLS[1], TOOLS[1]], tool_choice="required"), "same name"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "second constraint"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          tool_choice="required"), 'type "nonsense"'),
])
def test_tool_requests_that_cannot_be_served_are_a_400_naming_why(client, kw, mentions):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kw)
    assert mentions in str(e.value), e.value


def test_earlier_calls_and_their_results_can_be_sent_back(client):
    """An assistant turn with tool_calls and null content, then the tool's answer: accepted, answered."""
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"


# a template that shows tools and calls as the tool-using ones do (Qwen2.5's writes arguments with `tojson`)
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %} | {% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %} | {% endfor %}assistant:")


def test_tools_and_calls_reach_the_chat_template(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = TOOL_TEMPLATE
    request = GenerationRequest(tools=TOOLS, messages=[
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="assistant", content="", tool_calls=[
            ToolCall(id="c1", function=ToolCallFunction(name="get_weather", arguments='{"unit": "celsius"}'))]),
        ChatMessage(role="tool", content="20", tool_call_id="c1")])
    text = chat_prompt(request, tokenizer)
    # the arguments reach the template as an object, as vLLM hands them (not a JSON string inside JSON)
    assert text == ('TOOLS: get_weather now | user: hi | assistant: [c1 get_weather {"unit": "celsius"}] | '
                    'tool: 20(c1) | assistant:'), text


# ---- the stream's parser against the whole-text one, on any calls, spacing and split
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                 max_size=3), max_leaves=8)
_space = st.sampled_from(["", " ", "\n  ", "\t"])


@st.composite
def _calls_text(draw) -> tuple[list[tuple[str, str]], str]:
    calls = draw(st.lists(st.tuples(st.sampled_from(["a", "b[", 'q"}']),
                                    st.dictionaries(st.text(max_size=5), _json, max_size=3)), min_size=1, max_size=4))
    parts, want = [], []
    for name, params in calls:
        args = json.dumps(params, indent=draw(st.sampled_from([None, 1])))
        s = draw(_space)
        keys = [f'"name":{s}{json.dumps(name)}', f'"parameters":{s}{args}']
        if draw(st.booleans()):
            keys.reverse()
        parts.append("{" + s + f",{draw(_space)}".join(keys) + s + "}")
        want.append((name, args))
    return want, "[" + draw(_space) + f"{draw(_space)},".join(parts) + draw(_space) + "]"


@settings(max_examples=200, deadline=None)
@given(_calls_text(), st.lists(st.integers(1, 7), max_size=40))
def test_streamed_required_calls_are_the_calls_of_the_whole_text(calls_text, cuts):
    want, text = calls_text
    message = ToolCalls(None).message(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == want
    stream, got, pos = ToolCallStream(None), [], 0
    for n in [*cuts, len(text)]:
        got += stream.feed(text[pos:pos + n])
        pos += n
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in got] == \
        [(i, name, args) for i, (name, args) in enumerate(want)]
    assert ToolCalls(None).message(text[:-1])["content"] == text[:-1]  # cut short: the text, no calls
