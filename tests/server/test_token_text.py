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
