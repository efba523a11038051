"""Incremental detokenization and the stop rules (vLLM's), one sequence at a time.

Text: each new token decodes a short window of output ids (from `prefix_offset`); what the window adds
beyond the ids up to `read_offset` is appended to `seq.text` once it no longer ends in a partial
character. `seq.text` only grows, except when a stop string cuts it.

Stops, once `min_tokens` are out:
- a stop token (stop_token_ids; EOS unless ignore_eos) ends the sequence; its text is dropped unless
  include_stop_str_in_output (EOS is special and decodes to nothing either way);
- a stop string ends it where it first completes, as if the text arrived one character at a time;
  the text is cut before the string (after it with include_stop_str_in_output).

A running sequence with stop strings reports its text less the last len(longest stop) - 1 characters:
they may be the start of a stop string, and streamed text cannot be taken back. So every text reported
is a prefix of the final one.
"""
from collections.abc import Callable

from engine_service.engine.sampling_params import SamplingParams
from engine_service.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer, stop_ids: Callable[[SamplingParams], set[int]]):
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids  # a request's stop tokens: its stop_token_ids, and EOS unless ignore_eos

    def append(self, seq: Sequence, last: bool) -> bool:
        """Detokenize the newest token of seq.token_ids; `last`: none follows (pending text is flushed).
        Returns whether a stop token or stop string ends the sequence here; its text is then final."""
        p = seq.request.params
        ids = seq.output_token_ids
        active = len(ids) >= p.min_tokens
        stop_token = active and ids[-1] in self.stop_ids(p)
        if stop_token and not p.include_stop_str_in_output:
            ids = ids[:-1]
        before = len(seq.text)
        seq.text += self._decode_new(seq, ids, flush=last or stop_token)
        return (active and bool(p.stop) and self._cut_at_stop_string(seq, before)) or stop_token

    def visible_text(self, seq: Sequence) -> str:
        """The text to report now: all of it once finished, else less what may start a stop string."""
        p = seq.request.params
        if seq.is_finished or not p.stop or p.include_stop_str_in_output:
            return seq.text
        hold = max(len(s) for s in p.stop) - 1
        return seq.text[:max(0, len(seq.text) - hold)]

    def decode(self, ids: list[int], p: SamplingParams) -> str:
        """Whole-output decode (beam hypotheses): a trailing stop token's text is dropped as above."""
        if ids and ids[-1] in self.stop_ids(p) and not p.include_stop_str_in_output:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self, seq: Sequence, ids: list[int], flush: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
        full = decode(ids[seq.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and (flush or not full.endswith("\ufffd")):
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
            return full[len(prefix):]
        return ""

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, before: int) -> bool:
        """Look for stop strings that end in the text added after `before`; cut at the one ending first."""
        hits = []
        for stop in seq.request.params.stop:
            at = seq.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                hits.append((at + len(stop), at))
        if not hits:
            return False
        end, at = min(hits)
        seq.text = seq.text[:end if seq.request.params.include_stop_str_in_output else at]
        return True


def eos_token_ids(hf_config, tokenizer, model_dir) -> set[int]:
    """Every EOS id the model declares: its config, its tokenizer, its generation_config.json."""
    ids: set[int] = set()
    for source in (hf_config.eos_token_id, tokenizer.eos_token_id, _generation_eos(model_dir)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def _generation_eos(model_dir):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        return None
