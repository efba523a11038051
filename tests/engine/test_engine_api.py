"""The engine's public surface: input validation, abort, RequestOutput and metrics, LLM.chat, and
`decodelab generate --json`."""
import json
import math
import os
from dataclasses import fields

import pytest

from engine_service import LLM, SamplingParams
from engine_service.cli import main
from engine_service.engine.outputs import CompletionOutput, RequestOutput
from tests.helpers import GREEDY, random_prompt
from tests.hf_oracle import assert_greedy_matches, hf_greedy

THREADS = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
SIX = SamplingParams(max_tokens=6, **GREEDY)  # six greedy tokens


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, num_threads=THREADS)


@pytest.fixture
def engine(llm):
    engine = llm.engine
    assert not engine.has_unfinished()
    yield engine
    for rid in list(engine.requests):  # leave the shared engine idle whatever the test did
        engine.abort(rid)


def drain(engine) -> dict:
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


# ---- bad input

BAD_PARAMS = [
    ("max_tokens", 0), ("temperature", -0.5), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 0), ("n", 0), ("mode", "fast"),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS)
def test_bad_sampling_params_raise_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value})


def broken(field: str, value):
    """Params that passed validation and were changed afterwards: add_request validates again."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    setattr(params, field, value)
    return params


BAD_REQUESTS = [
    ("prompt", "", SIX),
    ("prompt", [], SIX),
    ("prompt_token_ids", [5, 6, 10**6], SIX),
    ("prompt_token_ids", [5, -1], SIX),
    ("max_tokens", [5] * 2040, SamplingParams(temperature=0.0, max_tokens=16)),  # context is 2048
    *[(field, [5, 6, 7], broken(field, value)) for field, value in BAD_PARAMS],
]


@pytest.mark.parametrize("field,prompt,params", BAD_REQUESTS,
                         ids=[f"{f}-{i}" for i, (f, *_) in enumerate(BAD_REQUESTS)])
def test_bad_request_raises_a_value_error_naming_the_field(engine, field, prompt, params):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished() and "bad" not in engine.requests


def test_refused_requests_leave_the_engine_serving_the_others(engine, tiny_llama_dir):
    a, b = random_prompt(13, 1), random_prompt(21, 2)
    engine.add_request("a", a, SIX)
    engine.step()  # "a" is in flight while the bad ones arrive
    for field, prompt, params in BAD_REQUESTS + [("request_id", [5, 6], SIX)]:
        with pytest.raises(ValueError, match=rf"^{field}\b"):
            engine.add_request("a" if field == "request_id" else "bad", prompt, params)
    engine.add_request("b", b, SIX)
    finals = drain(engine)
    assert set(finals) == {"a", "b"}
    for ids, out in ((a, finals["a"]), (b, finals["b"])):
        assert_greedy_matches(tiny_llama_dir, ids, out.outputs[0].token_ids, hf_greedy(tiny_llama_dir, ids, 6))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), num_kv_blocks=16, num_threads=THREADS).engine
    with pytest.raises(ValueError, match=r"^stop_token_ids\b"):
        engine.add_request("bad", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2,
                                                            stop_token_ids=[10**6]))


def test_a_request_bigger_than_the_kv_pool_is_refused_naming_max_tokens_and_the_pool(engine):
    # the pool holds 64 blocks of 8 = 512 tokens, well inside the 2048-token context: no wait would ever fit it
    with pytest.raises(ValueError, match=r"^max_tokens: 513 tokens need more KV blocks than the pool has \(64 x 8\)"):
        engine.add_request("big", random_prompt(13, 10), SamplingParams(max_tokens=500, **GREEDY))
    assert not engine.has_unfinished() and "big" not in engine.requests
    engine.add_request("fits", random_prompt(12, 10), SamplingParams(max_tokens=500, **GREEDY))  # exactly 512
    assert engine.has_unfinished()


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match=r"^stop\b"):
        SamplingParams(stop=["", "end"])


# ---- abort, has_unfinished

def test_has_unfinished_follows_the_requests(engine):
    engine.add_request("r", random_prompt(5, 3), SamplingParams(max_tokens=2, **GREEDY))
    assert engine.has_unfinished()
    drain(engine)
    assert not engine.has_unfinished() and not engine.requests


def test_abort_frees_the_blocks_at_once(engine):
    bm = engine.block_manager
    idle = bm.num_free_blocks
    engine.add_request("long", random_prompt(40, 4), SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("queued", random_prompt(9, 5), SIX)
    engine.step()
    engine.step()
    assert bm.num_free_blocks < idle
    engine.abort("long")
    engine.abort("queued")
    assert bm.num_free_blocks == idle == bm.num_blocks
    assert not engine.has_unfinished() and engine.step() == []
    engine.abort("long")  # aborting twice, or an unknown id, is a no-op
    engine.abort("never-added")


def test_abort_before_the_first_step(engine):
    engine.add_request("w", random_prompt(7, 6), SIX)
    engine.abort("w")
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- outputs and metrics

def test_request_output_uses_vllm_names_and_holds_generated_ids_only(llm):
    assert {"request_id", "prompt", "prompt_token_ids", "outputs", "finished", "metrics"} <= \
        {f.name for f in fields(RequestOutput)}
    assert {"index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason"} <= \
        {f.name for f in fields(CompletionOutput)}
    ids = random_prompt(11, 7)
    text_out, ids_out = llm.generate(["Once upon a time", {"prompt_token_ids": ids}], SIX)
    assert text_out.finished and text_out.prompt == "Once upon a time"
    assert text_out.prompt_token_ids == llm.tokenizer("Once upon a time").input_ids
    assert ids_out.prompt is None and ids_out.prompt_token_ids == ids
    for out in (text_out, ids_out):
        [c] = out.outputs
        assert (c.index, len(c.token_ids), c.finish_reason, c.logprobs) == (0, 6, "length", None)
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert isinstance(c.cumulative_logprob, float) and c.cumulative_logprob < 0


def test_streamed_outputs_hold_everything_so_far_and_finish_once(engine):
    engine.add_request("s", random_prompt(6, 8), SamplingParams(max_tokens=4, **GREEDY))
    stream = []
    while engine.has_unfinished():
        stream += [out for out in engine.step() if out.request_id == "s"]
    assert [len(o.outputs[0].token_ids) for o in stream] == [1, 2, 3, 4]
    assert [o.finished for o in stream] == [False, False, False, True]
    assert all(o.outputs[0].token_ids == stream[-1].outputs[0].token_ids[:i + 1] for i, o in enumerate(stream))


def test_metrics_are_present_and_sane(llm):
    ids = random_prompt(20, 9)  # two full blocks of 8 and a partial one
    first, second = (llm.generate({"prompt_token_ids": ids}, SIX)[0].metrics for _ in range(2))
    for m in (first, second):
        assert 0 <= m.queue_time <= m.ttft <= m.e2e < 60
        assert m.tpot > 0 and m.ttft + m.tpot * (m.generated_tokens - 1) <= m.e2e + 1e-6
        assert (m.prompt_tokens, m.generated_tokens) == (20, 6)
    assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, 16)
    assert {"queue_time", "ttft", "tpot", "e2e", "prompt_tokens", "cached_prompt_tokens",
            "generated_tokens"} <= set(first.to_dict())


def test_chat_applies_the_chat_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    templated = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                 "<|im_start|>assistant\n")
    [chat] = llm.chat(messages, SIX)
    assert chat.prompt == templated
    assert chat.prompt_token_ids == llm.tokenizer(templated).input_ids
    assert chat.outputs[0].token_ids == llm.generate(templated, SIX)[0].outputs[0].token_ids
    assert len(llm.chat([messages, messages[1:]], SIX)) == 2  # a list of conversations


# ---- decodelab generate --json

def test_generate_json_prints_one_object_per_prompt_in_input_order(tiny_llama_dir, llm, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text('{"prompt": "Readability counts."}\n\n{"prompt_token_ids": [5, 6, 7, 8]}\n')
    rc = main(["generate", "--model", str(tiny_llama_dir), "--num-kv-blocks", "32", "--threads", "1",
               "--max-tokens", "3", "--ignore-eos", "--logprobs", "1", "--json",
               "--prompt", "Once upon a time", "--prompt", "The quick brown fox", "--prompts-file", str(prompts_file)])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    objects = [json.loads(line) for line in lines]
    tok = llm.tokenizer
    assert [o["prompt_token_ids"] for o in objects] == [
        tok("Once upon a time").input_ids, tok("The quick brown fox").input_ids, tok("Readability counts.").input_ids,
        [5, 6, 7, 8]]
    greedy = SamplingParams(max_tokens=3, **GREEDY)
    for o in objects:
        assert {"prompt_token_ids", "outputs", "metrics"} <= set(o)
        [out] = o["outputs"]
        assert {"token_ids", "text", "finish_reason", "cumulative_logprob", "logprobs"} <= set(out)
        assert (len(out["token_ids"]), out["finish_reason"]) == (3, "length")
        assert out["token_ids"] == llm.generate({"prompt_token_ids": o["prompt_token_ids"]},
                                                greedy)[0].outputs[0].token_ids
        assert [str(t) in d for t, d in zip(out["token_ids"], out["logprobs"])] == [True] * 3
        assert {"ttft", "e2e", "prompt_tokens", "generated_tokens"} <= set(o["metrics"])


def test_generate_rejects_a_bad_prompts_file_line(tmp_path, capsys):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    assert main(["generate", "--model", "unused", "--prompts-file", str(prompts_file)]) == 2
    assert f"{prompts_file}:2" in capsys.readouterr().err
