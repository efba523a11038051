import math
from dataclasses import dataclass, field

MODES = ("greedy", "sample", "beam", "speculative")
# temperatures below this decode greedily (like vLLM's _SAMPLING_EPS): tinier ones overflow the scaled logits
SAMPLING_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's shape): exactly one of `json` (a JSON schema, dict or string),
    `regex`, `choice` (one of these strings), `grammar` (EBNF, xgrammar's dialect) or `json_object=True` (any JSON
    object). The engine compiles it with xgrammar and masks every step's logits (engine/structured.py)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False  # JSON: the compact separators only, no free whitespace

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] * (self.json_object is True)
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs: json must be a JSON schema (object or string), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs: {name} must be a non-empty string, got {value!r}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs: choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        if not isinstance(self.json_object, bool) or not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs: json_object and disable_any_whitespace must be true or false")


MAX_STAGE_TOKENS = 64  # sampler_stages: tokens reported per stage (the what-if view rebuilds from them)


@dataclass
class SamplingParams:
    """Per-request decoding parameters; field names follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1  # -1 (or 0 in HF terms) disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's: logit[t] -= presence * (count[t] > 0) + frequency * count[t], counting generated tokens only
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling, in [-100, 100]
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the matched stop string / the stop token's text
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # per prompt token after the first: {id: log-prob} of its top-N plus the token itself (RequestOutput)
    prompt_logprobs: int | None = None
    # the sampler pipeline per generated token (pipeline.py): the distribution after each processor, its top-N
    # tokens; 0: off (no cost). Greedy and sample modes.
    sampler_stages: int = 0
    # decoding mode; None derives it from temperature (0 -> greedy, else sample)
    mode: str | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    proposer: str = "ngram"  # speculative: "ngram" (prompt lookup) or "draft" (the engine's draft_model)
    num_speculative_tokens: int = 4
    # "constant": k drafts a step; "heuristic": HF assisted generation's schedule (num_assistant_tokens_schedule):
    # a sequence's draft length grows by 2 (up to k) when a step kept all its drafts, else shrinks by 1 (down to 1)
    speculative_schedule: str = "constant"
    ngram_min: int = 1  # n-gram proposer: shortest / longest suffix looked up in the context
    ngram_max: int = 3
    # grammar-constrained decoding (a dict is taken as StructuredOutputsParams' fields), in every mode
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if self.mode is None:
            self.mode = "greedy" if self.temperature == 0 else "sample"
        self.validate()

    @property
    def greedy(self) -> bool:
        """Argmax decoding (greedy mode, or sample/speculative at temperature ~0); beam search is separate."""
        return self.mode == "greedy" or (self.mode != "beam" and self.temperature < SAMPLING_EPS)

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if self.mode not in MODES:
            bad("mode", f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a number >= 0, got {self.temperature!r}")
        if math.isinf(self.temperature):
            bad("temperature", "must be finite")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0
                and math.isfinite(self.repetition_penalty)):
            bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if not isinstance(self.sampler_stages, int) or not 0 <= self.sampler_stages <= MAX_STAGE_TOKENS:
            bad("sampler_stages", f"must be an integer in [0, {MAX_STAGE_TOKENS}], got {self.sampler_stages!r}")
        if self.sampler_stages and self.mode in ("beam", "speculative"):
            bad("sampler_stages", f"reported in greedy and sample modes only, got mode={self.mode!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2 <= value <= 2):
                bad(name, f"must be a number in [-2, 2], got {value!r}")
        if self.logit_bias is not None and not (isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and -100 <= b <= 100
                for t, b in self.logit_bias.items())):
            bad("logit_bias", f"must map token ids to biases in [-100, 100], got {self.logit_bias!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            bad("beam_width", f"must be an integer >= 1, got {self.beam_width!r}")
        if not all(isinstance(x, str) and x for x in self.stop):
            bad("stop", f"stop strings must be non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be non-negative token ids, got {self.stop_token_ids!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output", f"must be true or false, got {self.include_stop_str_in_output!r}")
        if self.early_stopping not in (True, False, "never"):
            bad("early_stopping", f"must be True, False or 'never', got {self.early_stopping!r}")
        if self.proposer not in ("draft", "ngram"):
            bad("proposer", f"must be 'draft' or 'ngram', got {self.proposer!r}")
        if self.speculative_schedule not in ("constant", "heuristic"):
            bad("speculative_schedule", f"must be 'constant' or 'heuristic', got {self.speculative_schedule!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            bad("num_speculative_tokens", f"must be in [1, 16], got {self.num_speculative_tokens!r}")
        if not isinstance(self.ngram_min, int) or not isinstance(self.ngram_max, int) \
                or not 1 <= self.ngram_min <= self.ngram_max <= 16:
            bad("ngram_min", f"need 1 <= ngram_min <= ngram_max <= 16, got {self.ngram_min!r}, {self.ngram_max!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", f"must be StructuredOutputsParams, got {self.structured_outputs!r}")
            self.structured_outputs.validate()
            if self.min_tokens:  # the grammar decides where the output ends: banning its stop token could mask all
                bad("min_tokens", "not supported with structured_outputs (the grammar decides where the output ends)")
        if self.mode == "beam":
            self._validate_beam(bad)
        elif self.beam_width != 1:
            bad("beam_width", f"only mode='beam' uses beam_width; got {self.beam_width} with mode={self.mode!r}")
        if self.mode == "speculative" and self.n != 1:
            bad("n", "speculative decoding gives one output per request; use n=1")
        if self.mode == "greedy" and self.n > 1:
            bad("n", "greedy decoding gives one output; use mode='sample' or 'beam' for n > 1")

    def _validate_beam(self, bad) -> None:
        # HF generate(num_beams=W, do_sample=False): deterministic, so the sampling knobs must stay neutral
        if self.temperature not in (0, 1):
            bad("temperature", f"beam search is deterministic (HF do_sample=False): use 0 or 1 (both mean "
                               f"no temperature), got {self.temperature!r}")
        for name, neutral in (("top_k", -1), ("top_p", 1.0), ("min_p", 0.0)):
            if getattr(self, name) != neutral:
                bad(name, f"only sampling uses {name}; beam search needs the default {neutral}")
        if self.stop:
            bad("stop", "stop strings are not supported with beam search; use stop_token_ids")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            bad("length_penalty", f"must be a finite number, got {self.length_penalty!r}")
        if self.n > self.beam_width:
            bad("n", f"beam search returns at most beam_width={self.beam_width} beams, got n={self.n}")
