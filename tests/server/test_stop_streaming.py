"""Streaming through a real replica: text streamed before a stop string is known is never taken back,
so what a client accumulates equals the final text."""
from engine_service.engine.sampling_params import SamplingParams
from shared.client import EngineClient, TextAccumulator
from shared.protocol import DoneEvent, GenerationRequest, SamplingOptions, TokenEvent

from .conftest import run

PROMPT = "Once upon a time"
GREEDY = dict(temperature=0, ignore_eos=True, max_tokens=24)


def spanning_stop(tokenizer, text: str, token_ids: list[int]) -> str:
    """A stop string that starts inside one generated token and ends inside the token two further on."""
    texts = [tokenizer.decode([t]) for t in token_ids]
    for j in range(len(texts) - 2):
        a, b, c = texts[j:j + 3]
        if len(a) >= 2 and len(c) >= 2 and (a + b + c).isascii() and (a + b + c).isprintable():
            stop = a[1:] + b + c[:1]
            if text.find(stop) == len("".join(texts[:j])) + 1:
                return stop
    raise AssertionError(f"no ASCII run of three tokens in {text!r}")


def test_the_streamed_text_equals_the_final_text_when_a_stop_string_spans_tokens(
        spawn_replica, redis_server, keys, reference_engine):
    ref = reference_engine.generate([PROMPT], SamplingParams(**GREEDY))[0].outputs[0]
    stop = spanning_stop(reference_engine.tokenizer, ref.text, ref.token_ids)
    spawn_replica("A").wait_ready()

    async def main():
        client = EngineClient(redis_server.url, keys)
        sub = await client.submit(GenerationRequest(prompt=PROMPT, params=SamplingOptions(stop=[stop], **GREEDY)))
        acc, pieces, done = TextAccumulator(), [], None
        async for ev in client.stream(sub, 60):
            if isinstance(ev, TokenEvent):
                pieces.append(acc.feed(ev))
            else:
                done = ev
                pieces.append(acc.final(0, ev.text))
        await client.close()
        return pieces, done

    pieces, done = run(main(), 90)
    assert isinstance(done, DoneEvent) and done.finish_reason == "stop"
    assert done.text == ref.text[:ref.text.find(stop)]
    assert "".join(pieces) == done.text
