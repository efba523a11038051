"""The playground's API (what the Run button calls), driven by gradio_client against a real replica and Redis."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from gradio_client import Client

from engine_service.engine.sampling_params import SamplingParams
from tests.helpers import wait_until
from web.modes import MAX_PROMPT_CHARS

PROMPT = "Readability counts. The capital of France is Paris, and the capital of Italy is"
BASE = dict(prompt=PROMPT, chat=False, system_prompt="", max_tokens=24, model="tiny", share=True, beam_width=3,
            length_penalty=1.0, beams_shown=2, temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=7, n=2,
            proposer="ngram", spec_k=3)
TIMEOUT = 60


def run(client: Client, **overrides) -> tuple:
    job = client.submit(**{**BASE, **overrides}, api_name="/run")
    result = job.result(timeout=TIMEOUT)
    return result, job.outputs()


def columns(result) -> dict:
    return result[-1]["columns"]


def reference(llm, prompt: str, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def test_run_streams_four_mode_correct_columns(tiny_stack, tiny_reference):
    web, _, _ = tiny_stack
    result, frames = run(Client(web.url, verbose=False))
    cols = columns(result)
    assert len(frames) >= 3  # streamed: several updates before the final one
    greedy = reference(tiny_reference, PROMPT, temperature=0, max_tokens=24).outputs[0]
    assert cols["greedy"]["status"] == "done"
    assert cols["greedy"]["outputs"][0]["token_ids"] == greedy.token_ids
    assert cols["greedy"]["outputs"][0]["text"] == greedy.text

    sample = reference(tiny_reference, PROMPT, mode="sample", temperature=0.8, top_k=40, top_p=0.9, min_p=0.05,
                       seed=7, n=2, max_tokens=24)
    assert cols["sample"]["status"] == "done"
    assert [o["token_ids"] for o in cols["sample"]["outputs"]] == [o.token_ids for o in sample.outputs]

    spec = cols["speculative"]
    assert spec["status"] == "done", spec["error"]
    assert spec["outputs"][0]["token_ids"] == greedy.token_ids  # verification against greedy is lossless
    marks = spec["outputs"][0]["spec"]
    assert len(marks) == len(greedy.token_ids) and set(marks) <= {"accepted", "resampled", "bonus", "target"}

    beam = reference(tiny_reference, PROMPT, mode="beam", beam_width=3, n=2, max_tokens=24, length_penalty=1.0)
    assert cols["beam"]["status"] == "done", cols["beam"]["error"]
    assert [o["token_ids"] for o in cols["beam"]["outputs"]] == [o.token_ids for o in beam.outputs]

    for mode in ("greedy", "sample", "speculative"):
        m = cols[mode]["metrics"]
        assert m["ttft_s"] > 0 and m["tokens"] == 24 and m["tokens_per_s"] > 0 and m["replica"] == "tiny-1"
    html = result[1]
    assert 'data-status="done"' in html and "TTFT" in html and 'data-alts="' in html  # hover: top alternatives
    assert "Replica <b>tiny-1</b>" in result[5] and 'class="bmap"' in result[5]  # KV panel


def test_chat_template_and_system_prompt_reach_the_engine(tiny_stack, tiny_reference):
    web, _, _ = tiny_stack
    result, _ = run(Client(web.url, verbose=False), chat=True, system_prompt="Be brief.", prompt="Hello there")
    templated = tiny_reference.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        tokenize=False, add_generation_prompt=True)
    want = reference(tiny_reference, templated, temperature=0, max_tokens=24).outputs[0]
    assert columns(result)["greedy"]["outputs"][0]["token_ids"] == want.token_ids


def test_invalid_controls_are_reported_in_their_column_and_the_others_still_run(tiny_stack):
    web, _, _ = tiny_stack
    result, _ = run(Client(web.url, verbose=False), beam_width=2, beams_shown=4, top_k=-5)
    cols = columns(result)
    assert cols["beam"]["status"] == "invalid" and "cannot exceed the beam width" in cols["beam"]["error"]
    assert cols["sample"]["status"] == "invalid" and "top-k" in cols["sample"]["error"]
    assert cols["greedy"]["status"] == cols["speculative"]["status"] == "done"
    assert "cannot exceed the beam width" in result[2] and 'role="alert"' in result[2]


@pytest.mark.parametrize("prompt, error", [("", "Type a prompt"), ("   ", "Type a prompt"),
                                           ("x" * (MAX_PROMPT_CHARS + 1), "too long")])
def test_empty_or_too_long_prompts_are_refused_before_anything_is_sent(tiny_stack, prompt, error):
    web, _, keys = tiny_stack
    result, _ = run(Client(web.url, verbose=False), prompt=prompt)
    assert error in result[0] and error in result[-1]["error"]


def test_a_prompt_beyond_the_models_context_gets_the_engines_error_in_every_column(tiny_stack):
    web, _, _ = tiny_stack
    result, _ = run(Client(web.url, verbose=False), prompt="word " * 1500, max_tokens=512, beams_shown=1)
    for col in columns(result).values():
        assert col["status"] == "error" and "context" in col["error"]


def test_stop_cancels_every_running_column(tiny_stack):
    web, _, _ = tiny_stack
    client = Client(web.url, verbose=False)
    job = client.submit(**{**BASE, "max_tokens": 1000, "share": False, "beams_shown": 1}, api_name="/run")
    wait_until(lambda: any('data-status="running"' in str(f) for f in job.outputs()), TIMEOUT, 0.05,
               "a column to start running")
    client.predict(api_name="/stop")
    cols = columns(job.result(timeout=TIMEOUT))
    assert {m: c["status"] for m, c in cols.items()} == dict.fromkeys(("greedy", "beam", "sample", "speculative"),
                                                                       "cancelled")
    for c in cols.values():
        assert c["metrics"]["tokens"] < 1000


def test_a_second_run_in_the_session_ends_the_first_which_still_answers_with_its_data(tiny_stack):
    """The page draws only the newest run of a session (a second Run replaces the first); an API client that
    submits two runs in one session still gets the first one's data, its columns cancelled."""
    web, _, _ = tiny_stack
    client = Client(web.url, verbose=False)
    first = client.submit(**{**BASE, "max_tokens": 1000, "share": False, "beams_shown": 1}, api_name="/run")
    wait_until(lambda: any('data-status="running"' in str(f) for f in first.outputs()), TIMEOUT, 0.05,
               "a column to start running")
    second = client.submit(**{**BASE, "max_tokens": 8}, api_name="/run")
    cols = columns(first.result(timeout=TIMEOUT))
    assert {c["status"] for c in cols.values()} == {"cancelled"}, cols
    assert all(c["metrics"]["tokens"] < 1000 for c in cols.values())
    cols = columns(second.result(timeout=TIMEOUT))
    assert {c["status"] for c in cols.values()} == {"done"}, cols
    assert cols["greedy"]["metrics"]["tokens"] == 8


def test_two_sessions_stream_their_own_requests_batched_together(tiny_stack, tiny_reference):
    web, replica, _ = tiny_stack
    prompts = ["The quick brown fox", "Once upon a time there was"]
    results: dict[int, tuple] = {}

    def one(i: int) -> None:
        results[i] = run(Client(web.url, verbose=False), prompt=prompts[i], max_tokens=300, share=False,
                         beams_shown=1, n=1)

    def batched() -> float:
        text = httpx.get(f"http://127.0.0.1:{replica.port}/metrics", timeout=5).text
        le4 = float(re.search(r'decodelab_batch_size_bucket\{le="4\.0"\} (\S+)', text).group(1))
        return float(re.search(r"decodelab_batch_size_count (\S+)", text).group(1)) - le4

    before = batched()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    for i, prompt in enumerate(prompts):
        want = reference(tiny_reference, prompt, temperature=0, max_tokens=300).outputs[0]
        assert columns(results[i][0])["greedy"]["outputs"][0]["token_ids"] == want.token_ids
    assert batched() > before  # some engine steps advanced more than one session's four requests


def test_engine_down_and_redis_down_are_reported_at_once(engine_down_web, redis_down_web):
    t0 = time.monotonic()
    result, _ = run(Client(engine_down_web.url, verbose=False))
    assert "No engine replica" in result[0]
    result, _ = run(Client(redis_down_web.url, verbose=False))
    assert "Redis is unreachable" in result[0]
    assert time.monotonic() - t0 < 15
