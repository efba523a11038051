"""The OpenAI surface as clients nobody here wrote use it: the official `openai` package against the in-process app
over a real replica, and lm-eval-harness (local-completions, local-chat-completions) against a real `decodelab
engine` process. The expected numbers come from the engine itself, in-process (`reference_engine`)."""
import json
import logging
import threading
import time

import httpx
import openai
import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.api_models import JsonChatStr
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

from engine_service.engine.sampling_params import SamplingParams
from shared.keys import Keys
from shared.limits import Limits
from tests.helpers import GREEDY, random_prompt
from tests.replicas import Replica

PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.8)


@pytest.fixture
def oai(api):
    state, http = api
    return state, openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0)


def prompt_logprobs(reference_engine, ids: list[int], n: int = 1) -> list[dict | None]:
    out = reference_engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=n,
                                                                             **GREEDY))
    return out[0].prompt_logprobs


# ---- what OpenAI accepts is accepted

def test_null_means_the_default_for_every_optional_field(api):
    _, http = api
    nulls = {k: None for k in ("temperature", "top_p", "n", "stop", "seed", "logprobs", "user", "stream_options",
                               "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "suffix")}
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, **nulls})
    assert r.status_code == 200, r.text
    chat = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi", "name": None},
                                      {"role": "assistant", "content": None, "tool_calls": None},
                                      {"role": "user", "content": "again"}],
        "max_tokens": None, "max_completion_tokens": 3, "top_logprobs": None, "tools": None, **nulls})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 3


def test_unknown_fields_are_ignored_and_logged_once_per_request(oai, caplog):
    _, client = oai
    with caplog.at_level(logging.WARNING, logger="decodelab.api"):
        out = client.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                        extra_body={"unheard_of": 1, "stream_options": {"continuous_usage_stats": 1}})
    assert out.usage.completion_tokens == 2
    lines = [r.getMessage() for r in caplog.records if out.id in r.getMessage()]
    assert len(lines) == 1 and "unheard_of" in lines[0] and "stream_options.continuous_usage_stats" in lines[0]


def test_developer_role_text_parts_and_names_reach_the_chat_template(oai, reference_engine):
    _, client = oai
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                                  {"type": "text", "text": "Answer in French."}]},
                {"role": "user", "name": "ada", "content": [{"type": "text", "text": "Hi there"}]}]
    as_template_sees_it = [{"role": "system", "content": "Be brief.\nAnswer in French."},
                           {"role": "user", "content": "Hi there"}]
    want = reference_engine.chat(as_template_sees_it, SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0].text
    got = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want
    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_a_non_text_content_part_is_a_clear_400(oai):
    _, client = oai
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}])


# ---- sampling

def test_penalties_and_logit_bias_give_what_the_engine_gives(oai, reference_engine):
    _, client = oai
    bias = {42: 5.0, 300: -100.0}
    want = reference_engine.generate(["Once upon a time"], SamplingParams(max_tokens=16, logit_bias=bias, **PENALTIES,
                                                                           **GREEDY))[0].outputs[0]
    plain = reference_engine.generate(["Once upon a time"], SamplingParams(max_tokens=16, **GREEDY))[0].outputs[0]
    assert want.token_ids != plain.token_ids
    got = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                    logit_bias={str(k): v for k, v in bias.items()}, **PENALTIES,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                       logit_bias={str(k): v for k, v in bias.items()}, **PENALTIES, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_out_of_range_penalties_and_biases_are_400s(oai):
    _, client = oai
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logit_bias": {"5": 150}}):
        with pytest.raises(openai.BadRequestError, match=next(iter(kw))):
            client.completions.create(model="tiny", prompt="x", max_tokens=2, **kw)


def test_an_adaptive_speculative_schedule_gives_the_greedy_text_and_a_bad_one_is_a_400(oai, reference_engine):
    _, client = oai
    prompt = "one two three one two three one two three one"  # repeats: the n-gram lookup proposes
    want = reference_engine.generate([prompt], SamplingParams(max_tokens=16, **GREEDY))[0].outputs[0]
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={
        "ignore_eos": True, "mode": "speculative", "proposer": "ngram", "speculative_schedule": "heuristic"})
    assert got.choices[0].text == want.text
    with pytest.raises(openai.BadRequestError, match="speculative_schedule"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"speculative_schedule": "fast"})


# ---- batched prompts

def test_a_batch_of_prompts_numbers_choices_prompt_index_times_n_plus_j(oai):
    _, client = oai
    prompts = ["The capital of France", "Once upon", "def fibonacci(n):"]
    batch = client.completions.create(model="tiny", prompt=prompts, n=2, seed=7, temperature=0.9, max_tokens=6,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == list(range(6))
    for i, prompt in enumerate(prompts):  # each prompt as its own request: the same seeded samples
        alone = client.completions.create(model="tiny", prompt=prompt, n=2, seed=7, temperature=0.9, max_tokens=6,
                                          extra_body={"ignore_eos": True})
        assert [c.text for c in batch.choices[2 * i:2 * i + 2]] == [c.text for c in alone.choices]
    assert batch.usage.completion_tokens == 36


def test_a_batch_of_token_id_prompts_streams_every_choice(oai, reference_engine):
    _, client = oai
    prompts = [random_prompt(9, seed=1), random_prompt(5, seed=2)]
    want = [o.outputs[0].text for o in reference_engine.generate([{"prompt_token_ids": p} for p in prompts],
                                                                 SamplingParams(max_tokens=8, **GREEDY))]
    plain = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in plain.choices] == want
    texts = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want


# ---- echo and prompt log-probs

def test_echo_with_logprobs_gives_the_prompt_and_its_logprobs_first(oai, reference_engine):
    _, client = oai
    ids = random_prompt(12, seed=4)
    want = reference_engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, logprobs=2,
                                                                              prompt_logprobs=2, **GREEDY))[0]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True}).choices[0]
    prompt_text = reference_engine.tokenizer.decode(ids)
    assert got.text == prompt_text + want.outputs[0].text
    lp = got.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [want.prompt_logprobs[i][t] for i, t in enumerate(ids) if i] + \
               [d[t] for d, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])


def test_echo_of_a_text_prompt_with_max_tokens_0_scores_the_prompt_alone(oai, reference_engine):
    _, client = oai
    text = "The quick brown fox jumps over the lazy dog."
    ids = reference_engine.tokenizer(text).input_ids
    want = prompt_logprobs(reference_engine, ids)
    got = client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = got.choices[0]
    assert choice.text == text and got.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([want[i][t] for i, t in enumerate(ids) if i], abs=1e-4)
    streamed = list(client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text


def test_vllms_prompt_logprobs_extra_is_reported_as_vllm_reports_it(oai, reference_engine):
    _, client = oai
    ids = random_prompt(6, seed=9)
    want = prompt_logprobs(reference_engine, ids, 2)
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    scores = got.choices[0].model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(ids)
    for ours, theirs in zip(scores[1:], want[1:]):
        assert {int(t): v["logprob"] for t, v in ours.items()} == pytest.approx(theirs, abs=1e-4)


def test_max_tokens_0_without_echo_is_a_400(oai):
    _, client = oai
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)


# ---- usage, keep-alive, response_format, errors

def test_include_usage_ends_the_stream_with_usage_and_the_cached_prompt_tokens(oai):
    _, client = oai
    messages = [{"role": "user", "content": "The capital of France is Paris. The capital of Italy is Rome."}]
    kw = dict(model="tiny", messages=messages, max_tokens=4, temperature=0, stream=True,
              stream_options={"include_usage": True})
    first = list(client.chat.completions.create(**kw))
    again = list(client.chat.completions.create(**kw))
    for chunks in (first, again):
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].usage.completion_tokens == 4
    assert again[-1].usage.prompt_tokens == first[-1].usage.prompt_tokens >= 16
    assert again[-1].usage.prompt_tokens_details.cached_tokens >= 16  # the prefix cache held the prompt's blocks
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 16


def test_a_stream_waiting_in_the_queue_gets_keep_alive_comments(oai, api):
    state, client = oai
    _, http = api
    state.sse_keepalive_s = 0.1
    pulling = state.replica.state.pulling
    pulling.clear()  # the replica takes no new work: the request waits in the queue
    time.sleep(0.3)  # (a read already blocking in the intake thread could still take it: let it return)
    try:
        with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3,
                                                          "stream": True}) as r:
            lines = r.iter_lines()
            waited = [next(lines) for _ in range(4)]
            pulling.set()
            rest = list(lines)
        assert all(line in (": keep-alive", "") for line in waited) and ": keep-alive" in waited
        assert [line for line in rest if line][-1] == "data: [DONE]"
        pulling.clear()
        threading.Timer(0.5, pulling.set).start()  # the official client reads through the comments
        stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert len("".join(c.choices[0].text for c in stream)) > 0
    finally:
        pulling.set()


def test_a_stream_the_replica_refuses_is_the_400_it_is_without_stream(oai, api):
    """Only the replica knows a prompt's tokens against its context and KV pool. Found by a chaos run of concurrent
    requests (session 37): such a refusal, a 400 without `stream`, was a 200 stream holding an error typed
    server_error. Now the stream's response waits briefly for the replica's first event (as vLLM validates before
    it streams); a refusal later than that (a queued request) ends the stream, typed as its 400 would be."""
    state, client = oai
    _, http = api
    too_long = state.replica.state.engine.max_model_len
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            out = client.completions.create(model="tiny", prompt="Hi", max_tokens=too_long, stream=stream)
            list(out) if stream else None
        assert e.value.body["code"] == "invalid_request" and "context" in e.value.message
        with pytest.raises(openai.BadRequestError):
            out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=too_long, stream=stream)
            list(out) if stream else None
    with pytest.raises(openai.BadRequestError):  # one prompt of a batch refused: the batch is
        list(client.completions.create(model="tiny", prompt=["Hi", "Hi " * 8], max_tokens=too_long - 2, stream=True))
    kw = dict(model="tiny", prompt=["Hi", "Hello"], max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    whole = [c.text for c in client.completions.create(**kw).choices]
    texts = ["", ""]
    for c in client.completions.create(**kw, stream=True):  # the events held before the stream came first
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == whole
    state.sse_keepalive_s = 0.1  # (the wait is at most this)
    pulling = state.replica.state.pulling
    pulling.clear()  # queued past the wait: the refusal comes in the stream
    time.sleep(0.3)
    threading.Timer(0.5, pulling.set).start()
    try:
        with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": too_long,
                                                          "stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        pulling.set()
    error = json.loads(lines[0].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    assert "context" in error["message"]
    assert lines[-1] == "data: [DONE]"


def test_response_format_text_is_accepted(oai):  # json_object / json_schema: test_structured_outputs.py
    _, client = oai
    messages = [{"role": "user", "content": "Hi"}]
    ok = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, response_format={"type": "text"})
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_every_error_status_has_an_openai_shaped_body(oai):
    state, client = oai
    errors = {}

    def expect(cls, **kw):
        with pytest.raises(cls) as e:
            client.completions.create(**{"model": "tiny", "prompt": "x", "max_tokens": 2, **kw})
        errors[e.value.status_code] = e.value.response.json()["error"]

    expect(openai.BadRequestError, temperature=-1)
    expect(openai.NotFoundError, model="gpt-9")
    state.limits = Limits(max_request_bytes=2000)
    expect(openai.APIStatusError, prompt="x" * 3000)  # 413 before the body is read
    state.limits = Limits()
    state.client.max_queue = 0
    expect(openai.RateLimitError)
    state.client.max_queue = 256
    state.api_key = "s3cret"
    expect(openai.AuthenticationError)
    assert sorted(errors) == [400, 401, 404, 413, 429]
    assert all(e["message"] and e["type"] and "code" in e and "param" in e for e in errors.values())


# ---- lm-eval-harness against a real `decodelab engine` process

@pytest.fixture(scope="module")
def replica_process(tiny_llama_dir, redis_server):
    replica = Replica(tiny_llama_dir, redis_server.url, Keys("test-lm-eval"), "lm-eval", "--num-kv-blocks", "512",
                      "--max-num-seqs", "16").wait_ready()
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def completions_lm(replica_process, tiny_llama_dir):
    return LocalCompletionsAPI(base_url=f"{replica_process.url}/v1/completions", model="tiny", batch_size=4,
                               tokenizer_backend="huggingface", tokenizer=str(tiny_llama_dir), max_length=512,
                               max_retries=1)


CONTEXTS = [("The capital of France is", " Paris."), ("The capital of France is", " Rome."),
            ("Once upon a time there was", " a small robot"), ("def fibonacci(n):", " return n"),
            ("Readability", " counts.")]


def test_lm_eval_loglikelihood_equals_the_engines_prompt_logprobs(completions_lm, reference_engine):
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(CONTEXTS)]
    results = completions_lm.loglikelihood(requests, disable_tqdm=True)  # batches of 4 token-id prompts, echoed
    for (context, continuation), (logprob, greedy) in zip(CONTEXTS, results):
        ctx, cont = completions_lm._encode_pair(context, continuation)
        scores = prompt_logprobs(reference_engine, ctx + cont)
        rows = scores[len(ctx):]
        assert logprob == pytest.approx(sum(row[t] for row, t in zip(rows, cont)), abs=1e-3)
        assert greedy == all(row[t] == max(row.values()) for row, t in zip(rows, cont))


def test_lm_eval_generate_until_equals_greedy_decoding(completions_lm, reference_engine):
    gen = {"until": ["\n\n"], "max_gen_toks": 10, "do_sample": False}
    contexts = ["The capital of Italy is", "Beautiful is better than", "Simple is"]
    got = completions_lm.generate_until([Instance("generate_until", {}, (c, gen), i) for i, c in enumerate(contexts)],
                                        disable_tqdm=True)
    want = reference_engine.generate(contexts, SamplingParams(max_tokens=10, temperature=0, stop=["\n\n"]))
    assert got == [o.outputs[0].text for o in want]


def test_lm_eval_chat_generate_until_with_content_parts(replica_process, reference_engine):
    lm = LocalChatCompletion(base_url=f"{replica_process.url}/v1/chat/completions", model="tiny", max_retries=1)
    gen = {"until": ["."], "max_gen_toks": 10, "do_sample": False}
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is the capital of Spain?"}]}]
    got = lm.generate_until([Instance("generate_until", {}, (JsonChatStr(json.dumps(messages)), gen), 0)],
                            disable_tqdm=True)
    flat = [messages[0], {"role": "user", "content": "What is the capital of Spain?"}]
    want = reference_engine.chat(flat, SamplingParams(max_tokens=10, temperature=0, stop=["."]))[0].outputs[0].text
    assert got == [want]


def test_the_replica_process_answers_plain_http_too(replica_process):
    r = httpx.post(f"{replica_process.url}/v1/completions", json={"model": "tiny", "prompt": [[5, 6, 7], [8, 9]],
                                                                  "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    assert [len(c["logprobs"]["tokens"]) for c in r.json()["choices"]] == [3, 2]
