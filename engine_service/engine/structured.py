"""Grammar-constrained decoding (structured outputs) with xgrammar, in every decoding mode.

A request's `SamplingParams.structured_outputs` (a JSON schema, a regex, a list of choices, an EBNF grammar or
"any JSON object") becomes an xgrammar `Grammar` (`build_grammar`: no tokenizer needed, so the API checks it before
queueing), compiled once per distinct spec against the model's vocabulary (`StructuredDecoding`, a bounded cache).
Each Sequence gets its own `GrammarState`: an xgrammar matcher plus the number of output tokens it has accepted.

Per step, for every row about to be sampled, `masks(rows)` fills one row of a token bitmask (1 bit per token of
the logits' width) from the row's matcher; the sampler applies it to the logits before its processors
(`apply_mask`), so top-k / top-p / temperature act on the allowed tokens only and the row's distribution is the
model's, renormalised over what the grammar allows. The reported log-probs stay the raw model's.

- greedy / sample: mask, draw, `GrammarState.accept(token)`; a matcher that terminates (it accepted one of its
  stop tokens: the model's EOS) ends the sequence with finish_reason "stop"; a request's stop_token_ids stop it
  where they are drawn, as without a grammar.
- beam search: each beam owns a matcher; a forked beam gets `matcher.fork()` (a deep copy of the parse state)
  before either beam moves on, so both continue from the parent's state with no replay.
- speculative: drafts are cut at the first token the grammar refuses (`valid_prefix`); verification asks
  `masks` for rows at the prefix + drafts[:j]: the drafts are accepted into the matcher temporarily, one row's
  mask after each, and rolled back (`matcher.rollback`) afterwards; the verified tokens are then accepted as in
  any mode. The target's draw at each position is from its masked distribution, so the output is exactly a
  sample of the constrained target (the coupling argument of spec_decode.py holds for any p_t).
Contract: a GrammarState has accepted exactly `seq.output_token_ids[:num_accepted]`, and outside `masks` its
matcher sits right after them.
"""
import json
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xgrammar as xgr

from engine_service.engine.sampling_params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (LRU): a few MB each at most for a 50k-token vocabulary
# JSON's free whitespace, per gap between tokens of the JSON text: enough for indented output, and a small model
# cannot loop on newlines until max_tokens (a known failure of unbounded whitespace)
MAX_JSON_WHITESPACE = 24


def _fail(why: str) -> ValueError:
    return ValueError(f"structured_outputs: {why}")


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The spec's grammar, independent of any tokenizer; ValueError("structured_outputs: ...") when it is bad."""
    spec.validate()
    ws = not spec.disable_any_whitespace
    json_kw = dict(any_whitespace=ws, max_whitespace_cnt=MAX_JSON_WHITESPACE if ws else None)
    try:
        if spec.json is not None:
            try:
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            except ValueError as e:
                raise ValueError(f"json: the schema is not valid JSON ({e})") from None
            _check_enforceable(schema)
            return xgr.Grammar.from_json_schema(json.dumps(_lengths_as_patterns(schema)), **json_kw)
        if spec.json_object:
            # strict_mode=False: any members (strict would allow only {} for a schema without properties)
            return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), strict_mode=False, **json_kw)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:  # JSON string escapes are EBNF's too
            literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {literals}")
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError with its parser's message
        raise _fail(_short(e)) from None


# JSON Schema keywords whose values are data, not schemas: never rewritten
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# keywords whose values map names to schemas
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


# Keywords xgrammar 0.2.8 compiles to no constraint at all (checked one by one: a value that breaks them is accepted);
# `allOf` with several schemas makes the whole value unconstrained. vLLM refuses such schemas where xgrammar is its
# only backend; so do we, rather than return outputs the schema rejects with finish_reason "stop".
_UNENFORCED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
               "dependentSchemas")


def _check_enforceable(node, path: str = "$") -> None:
    """ValueError naming the first keyword of the schema the grammar would not enforce."""
    if isinstance(node, list):
        for i, x in enumerate(node):
            _check_enforceable(x, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    bad = next((k for k in _UNENFORCED if k in node), None)
    if bad is None and isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        bad = "allOf"
    if bad is None and node.get("uniqueItems") is True:
        bad = "uniqueItems"
    if bad is not None:
        raise ValueError(f"json: {bad!r} (at {path}) is not supported: the grammar cannot enforce it")
    for k, v in node.items():
        if k in _NAME_MAPS and isinstance(v, dict):  # names -> schemas: a property may be called "not"
            for name, sub in v.items():
                _check_enforceable(sub, f"{path}.{k}.{name}")
        elif k not in _DATA_KEYWORDS:
            _check_enforceable(v, f"{path}.{k}")


def _lengths_as_patterns(node):
    r"""The schema with every string's minLength / maxLength (where it has no pattern) as the pattern
    `^[\s\S]{min,max}$`. Why: xgrammar 0.2.8 compiles those bounds to a repetition of any character but `"`, `\`,
    CR and LF, so a bounded string could hold raw control characters, which JSON forbids: `{"s": "ab\x1dc"}` with
    finish_reason "stop", which json.loads refuses (mlc-ai/xgrammar#800; its fixes, #822 and #880, are not
    released). Its pattern path keeps to the characters JSON allows unescaped, counting code points as the bounds
    do. Neither path emits escapes (a bounded string holds no `"`, `\` or newline); a pattern with bounds keeps
    xgrammar's behaviour (the pattern alone)."""
    if isinstance(node, list):
        return [_lengths_as_patterns(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYWORDS else _lengths_as_patterns(v) for k, v in node.items()}
    lo, hi = out.get("minLength"), out.get("maxLength")
    bounds = [b for b in (lo, hi) if b is not None]
    if bounds and "pattern" not in out and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^[\\s\\S]{{{lo or 0},{'' if hi is None else hi}}}$"
    return out


def _short(e: Exception) -> str:
    # xgrammar's messages start with "[time] /path/file.cc:line: "; keep what follows
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
    return text.removeprefix("Check failed: (error.empty()) is false: ")


def spec_key(spec: StructuredOutputsParams) -> str:
    """A canonical string per distinct grammar (the compile cache's key)."""
    fields = {**spec.__dict__}
    if isinstance(fields["json"], str):  # the same schema written two ways compiles once
        try:
            fields["json"] = json.loads(fields["json"])
        except ValueError:
            pass
    return json.dumps(fields, sort_keys=True)


class GrammarState:
    """One sequence's matcher and how many of its output tokens it has accepted."""

    def __init__(self, matcher: xgr.GrammarMatcher, num_accepted: int = 0):
        self.matcher = matcher
        self.num_accepted = num_accepted

    def fork(self) -> "GrammarState":
        """An independent copy of the parse state (a beam that survives into several children)."""
        return GrammarState(self.matcher.fork(), self.num_accepted)

    def sync(self, output_ids: list[int]) -> None:
        """Accept the output tokens past those already accepted (each one the mask allowed)."""
        for token in output_ids[self.num_accepted:]:
            accepted = self.matcher.accept_token(token)
            assert accepted, f"token {token} was drawn under the grammar's mask, yet the grammar refuses it"
            self.num_accepted += 1

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def valid_prefix(self, output_ids: list[int], drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts after `output_ids` (the matcher is left as it was)."""
        assert len(output_ids) == self.num_accepted
        n = 0  # nothing after a draft that ends the grammar (xgrammar warns on every token offered past its end)
        while n < len(drafts) and not self.terminated and self.matcher.accept_token(drafts[n]):
            n += 1
        if n:
            self.matcher.rollback(n)
        return drafts[:n]


@dataclass
class GrammarMask:
    """Allowed tokens of some rows of a batch: xgrammar's bitmask [rows, ceil(vocab / 32)] int32 (bit set:
    allowed) and the batch rows it applies to (the others are unconstrained)."""

    bitmask: torch.Tensor
    rows: list[int]


def masks(rows: list[tuple[GrammarState | None, list[int]]], vocab_size: int) -> GrammarMask | None:
    """One mask row per (state, the row's output ids); None when no row has a grammar. A row's ids may run past
    what its state accepted (speculative verification: the drafts before it): those tokens are accepted for the
    row and rolled back at the end. A row behind a token the grammar refuses, or after the grammar ended, is
    left unconstrained: the refused draft is rejected before it (its row's mask forbids it)."""
    if all(state is None for state, _ in rows):
        return None
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)  # all allowed
    extra: dict[int, list[int]] = {}  # id(state) -> tokens accepted for these rows only
    states: dict[int, GrammarState] = {}
    try:
        masked = _fill(rows, bitmask, extra, states, vocab_size)
    finally:  # every matcher back right after what its sequence holds
        for key, have in extra.items():
            if have:
                states[key].matcher.rollback(len(have))
    return GrammarMask(bitmask, masked) if masked else None


def _allows_any(row: torch.Tensor, vocab_size: int) -> bool:
    """Whether a bitmask row allows some token of the vocabulary (xgrammar may leave the bits past it set)."""
    full, rest = divmod(vocab_size, 32)
    return bool(row[:full].any()) or (rest > 0 and int(row[full]) & ((1 << rest) - 1) != 0)


def _fill(rows: list[tuple[GrammarState | None, list[int]]], bitmask: torch.Tensor, extra: dict[int, list[int]],
          states: dict[int, GrammarState], vocab_size: int) -> list[int]:
    masked = []
    for i, (state, ids) in enumerate(rows):
        if state is None:
            continue
        assert len(ids) >= state.num_accepted
        want, have = ids[state.num_accepted:], extra.setdefault(id(state), [])
        states[id(state)] = state
        same = 0
        while same < min(len(want), len(have)) and want[same] == have[same]:
            same += 1
        if same < len(have):
            state.matcher.rollback(len(have) - same)
            del have[same:]
        ok = True
        for token in want[same:]:
            if state.terminated or not state.matcher.accept_token(token):  # (past the end: xgrammar would warn)
                ok = False
                break
            have.append(token)
        if ok and not state.terminated:
            state.matcher.fill_next_token_bitmask(bitmask, i)
            if not _allows_any(bitmask[i], vocab_size):  # a draw from nothing: the request ends (isolation.py)
                raise _fail(f"the grammar allows no token of this vocabulary after {len(ids)} output tokens")
            masked.append(i)
    return masked


def apply_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """Disallowed tokens' logits -> -inf, in place, on the mask's rows (xgrammar's kernel: CPU or CUDA; on a
    busy 2-core CPU ~0.25 ms for 8 x 49k logits, vs ~20 ms for unpacking the bits with torch ops)."""
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=mask.rows)


def masked_mass(logprobs: torch.Tensor, mask: GrammarMask | None) -> list[float | None]:
    """Per row of `logprobs` (log-softmax of the raw logits): the probability the grammar's mask removes, i.e.
    on the tokens it forbids (None for a row it does not constrain). What the playground shows per token."""
    out: list[float | None] = [None] * logprobs.shape[0]
    if mask is None:
        return out
    kept = logprobs.clone()
    apply_mask(kept, mask)
    allowed = kept[mask.rows].logsumexp(dim=-1).exp().tolist()
    for row, a in zip(mask.rows, allowed):
        out[row] = min(1.0, max(0.0, 1.0 - a))
    return out


class StructuredDecoding:
    """The engine's grammar compiler (built on first use: ~0.2 s for the tokenizer's vocabulary) and its
    cache of compiled grammars, one per distinct spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], max_threads: int = 2):
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self.num_compiled = 0

    def compiled(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        key = spec_key(spec)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        grammar = build_grammar(spec)
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise _fail(_short(e)) from None
        self.num_compiled += 1
        self.cache[key] = compiled
        if len(self.cache) > MAX_CACHED_GRAMMARS:
            self.cache.popitem(last=False)
        return compiled

    def new_state(self, spec: StructuredOutputsParams, stop_ids: set[int]) -> GrammarState:
        """A fresh matcher at the start of the output; it ends on accepting one of `stop_ids`."""
        assert stop_ids, "a grammar needs a stop token to end on"
        return GrammarState(xgr.GrammarMatcher(self.compiled(spec), override_stop_tokens=sorted(stop_ids)))
