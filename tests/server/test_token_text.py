"""events.token_text: a token's text alone, decoded once per tokenizer and id (every streamed token names itself
and its top alternatives)."""
from transformers import AutoTokenizer

from engine_service.server.events import token_logprobs, token_text


class Counting:
    """A real tokenizer that counts its decode calls."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, ids):
        self.calls += 1
        return self.tokenizer.decode(ids)


def test_token_text_is_decode_and_decodes_each_id_once(tiny_llama_dir):
    hf = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tok = Counting(hf)
    ids = [5, 17, 5, 200, 17, 5]
    assert [token_text(tok, i) for i in ids] == [hf.decode([i]) for i in ids]
    assert tok.calls == 3
    events = token_logprobs(tok, [17, 200], [{17: -0.1, 5: -2.0}, {200: -0.5, 17: -1.0}])
    assert [e.token for e in events] == [hf.decode([17]), hf.decode([200])]
    assert [t for e in events for _, t, _ in e.top] == [hf.decode([i]) for i in (17, 5, 200, 17)]
    assert tok.calls == 3  # every id was named before
    other = Counting(hf)  # another tokenizer: its own texts
    token_text(other, 5)
    assert other.calls == 1


class NoMemo(dict):
    """A memo that keeps nothing: every record is built afresh."""

    def __setitem__(self, key, value):
        pass


def test_a_beam_streams_the_same_events_with_the_memo_as_without(smollm2_dir):
    """token_events remembers each token's record by its engine entry (a beam's reset events re-send whole
    outputs every step): the events, and the done event, are those built without it, step by step."""
    from types import SimpleNamespace

    from engine_service.engine.config import EngineConfig
    from engine_service.engine.llm_engine import LLMEngine
    from engine_service.engine.sampling_params import SamplingParams
    from engine_service.server.events import done_event, token_events
    from engine_service.server.jobs import Job
    from shared.protocol import encode

    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), device="cpu", dtype="float32", max_num_seqs=8))

    def job():
        return Job(request=SimpleNamespace(request_id="b", created_at=0.0), entry_id="", attempt=1, picked_at=0.0,
                   stream="")

    memo, fresh = job(), job()
    fresh.logprob_memo = NoMemo()
    engine.add_request("b", "Why is the sky blue?", SamplingParams(mode="beam", beam_width=3, n=2, max_tokens=16,
                                                                  temperature=0.0, logprobs=3))
    resets = 0
    while engine.has_unfinished():
        for out in engine.step():
            ours, theirs = token_events(memo, out, engine.tokenizer), token_events(fresh, out, engine.tokenizer)
            assert [encode(e) for e in ours] == [encode(e) for e in theirs]
            resets += sum(e.reset for e in ours[1:] if e.logprobs and len(e.logprobs) > 1)
            if out.finished:
                done = [done_event(j, "length", out.outputs, engine.tokenizer, "r") for j in (memo, fresh)]
                assert done[0].model_dump(exclude={"metrics"}) == done[1].model_dump(exclude={"metrics"})
    assert memo.logprob_memo and resets  # records were remembered, and reused by resets
