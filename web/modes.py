"""The four playground columns: what each sends to the engine, and the inline checks on the controls.

The constraint control (none / JSON schema / regex / choice) becomes one `structured_outputs` that all four
requests carry; the web only checks its shape (JSON parses, not empty), the engine compiles it (xgrammar) and
answers an error event per request when it cannot.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pydantic import ValidationError

from shared.protocol import ChatMessage, GenerationRequest, SamplingOptions, StructuredOutputs

MODES = ("greedy", "beam", "sample", "speculative")
TITLES = {"greedy": "Greedy", "beam": "Beam search", "sample": "Sampling", "speculative": "Speculative"}
LOGPROBS = 5  # top alternatives shown on hover
PIPELINE_TOKENS = 16  # "Sampler pipeline": tokens per stage the engine reports (the what-if view rebuilds from them)
MAX_PROMPT_CHARS = 8000
MAX_TOKENS_LIMIT = 1024
CONSTRAINTS = ("none", "JSON schema", "regex", "choice")


@dataclass
class Settings:
    """Everything the controls hold, as the UI gives it (numbers may arrive as floats or None)."""

    prompt: str = ""
    chat: bool = True
    system_prompt: str = ""
    max_tokens: int = 64
    model: str | None = None
    beam_width: int = 4
    length_penalty: float = 1.0
    beams_shown: int = 3
    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float = 0.95
    min_p: float = 0.0
    seed: int | None = 0
    n: int = 1
    proposer: str = "ngram"
    spec_k: int = 4
    # k adapts per step (SamplingParams.speculative_schedule "heuristic"): on this playground's default prompt the
    # n-gram proposer's drafts were kept 1 time in 87, and the k=4 rejected rows made a four-mode step 9% slower
    spec_adaptive: bool = True
    compare_proposers: bool = False  # also send the speculative request with the other proposer (Run.rival)
    constraint_type: str = "none"  # one of CONSTRAINTS
    constraint: str = ""  # the schema as JSON, the regex, or the choices one per line
    pipeline: bool = False  # sampling asks for each token's sampler pipeline (params.sampler_stages)


class InputError(ValueError):
    pass


def _int(name: str, value) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise InputError(f"{name}: must be a whole number, got {value}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: must be a whole number, got {value!r}") from None


def _float(name: str, value, empty: float | None = None) -> float:
    """A number box's value; an emptied box (None) is `empty` where that means "off", else an InputError, as is
    anything not finite."""
    if value is None or value == "":
        if empty is None:
            raise InputError(f"{name}: enter a number")
        return empty
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise InputError(f"{name}: must be a finite number, got {value}")
    return x


def check_prompt(s: Settings) -> str | None:
    """The error shown under the prompt box, or None."""
    if not s.prompt or not s.prompt.strip():
        return "Type a prompt first (or click one of the examples)."
    if len(s.prompt) > MAX_PROMPT_CHARS:
        return f"The prompt is too long: {len(s.prompt):,} characters (limit {MAX_PROMPT_CHARS:,})."
    if len(s.system_prompt or "") > MAX_PROMPT_CHARS:
        return f"The system prompt is too long: {len(s.system_prompt):,} characters (limit {MAX_PROMPT_CHARS:,})."
    try:
        max_tokens = _int("max tokens", s.max_tokens)
    except InputError as e:
        return str(e)
    if max_tokens is None or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        return f"max tokens: must be between 1 and {MAX_TOKENS_LIMIT}, got {s.max_tokens}"
    return None


def structured_outputs(s: Settings) -> StructuredOutputs | None:
    """The constraint all four columns carry, or None; InputError when its text cannot be one."""
    kind, text = s.constraint_type or "none", s.constraint or ""
    if kind == "none":
        return None
    if not text.strip():
        raise InputError(f"constraint ({kind}): the box is empty")
    if kind == "JSON schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"constraint: the JSON schema is not valid JSON ({e.msg}, line {e.lineno})") from None
        if not isinstance(schema, dict):
            raise InputError("constraint: a JSON schema is an object ({...})")
        return StructuredOutputs(json=schema)
    if kind == "regex":
        return StructuredOutputs(regex=text)  # as typed: spaces are part of a pattern
    if kind == "choice":
        return StructuredOutputs(choice=[line.strip() for line in text.splitlines() if line.strip()])
    raise InputError(f"constraint: unknown type {kind!r}")


def _options(mode: str, s: Settings) -> dict:
    common = dict(max_tokens=_int("max tokens", s.max_tokens), logprobs=LOGPROBS, mode=mode)
    if (constraint := structured_outputs(s)) is not None:  # none: the request stays as it was without the control
        common["structured_outputs"] = constraint
    if s.pipeline and mode == "sample":  # greedy's pipeline is its raw stage alone (the hover card has it): not
        common["sampler_stages"] = PIPELINE_TOKENS  # worth its page weight (bench playground --pipeline)
    if mode == "greedy":
        return dict(common, temperature=0.0)
    if mode == "beam":
        width, shown = _int("beam width", s.beam_width), _int("beams shown", s.beams_shown)
        if width is None or shown is None:
            raise InputError("beam width and beams shown are required")
        if shown > width:
            raise InputError(f"beams shown ({shown}) cannot exceed the beam width ({width})")
        return dict(common, beam_width=width, n=shown, length_penalty=_float("length penalty", s.length_penalty))
    if mode == "sample":
        top_k = _int("top-k", s.top_k)
        top_k = -1 if top_k in (None, 0) else top_k
        if top_k < -1:
            raise InputError(f"top-k: must be -1 or 0 (off) or a positive number, got {top_k}")
        return dict(common, temperature=_float("temperature", s.temperature), top_k=top_k,
                    top_p=_float("top-p", s.top_p, empty=1.0), min_p=_float("min-p", s.min_p, empty=0.0),
                    seed=_int("seed", s.seed), n=_int("n", s.n) or 1)
    if mode == "speculative":  # verified against the target's greedy choice: the text must equal greedy's
        return dict(common, temperature=0.0, proposer=s.proposer, num_speculative_tokens=_int("k", s.spec_k) or 1,
                    speculative_schedule="heuristic" if s.spec_adaptive else "constant")
    raise ValueError(f"unknown mode {mode!r}")


def other_proposer(proposer: str) -> str:
    return "draft" if proposer == "ngram" else "ngram"


def _short(e: ValidationError) -> str:
    names = {"top_p": "top-p", "min_p": "min-p", "top_k": "top-k", "num_speculative_tokens": "k",
             "beam_width": "beam width", "n": "n", "temperature": "temperature", "max_tokens": "max tokens"}
    parts = []
    for err in e.errors()[:3]:
        field = ".".join(str(x) for x in err["loc"])
        parts.append(f"{names.get(field, field)}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def build_request(mode: str, s: Settings, client_id: str = "") -> GenerationRequest:
    """The request one column sends; InputError (shown inline in that column) when a control is invalid."""
    try:
        params = SamplingOptions(**_options(mode, s))
    except ValidationError as e:
        raise InputError(_short(e)) from None
    if s.chat:
        messages = [ChatMessage(role="system", content=s.system_prompt)] if s.system_prompt.strip() else []
        messages.append(ChatMessage(role="user", content=s.prompt))
        return GenerationRequest(messages=messages, params=params, model=s.model or None, client_id=client_id)
    return GenerationRequest(prompt=s.prompt, params=params, model=s.model or None, client_id=client_id)
