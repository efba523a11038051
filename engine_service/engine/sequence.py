import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Protocol

import torch

from engine_service.engine.sampling_params import SamplingParams
from engine_service.engine.structured import GrammarState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """One token stream: the prompt plus what it generated. A request has n of them (samples, beams)."""

    seq_id: int
    request: "Request"
    token_ids: list[int]
    index: int = 0  # position in the request's outputs
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # beside logprobs: nats of each raw distribution
    # beside logprobs, with a grammar: the raw probability the grammar's mask removed at each position
    masked: list[float | None] = field(default_factory=list)
    # params.sampler_stages: per generated token, its sampler pipeline (pipeline.StageRecord dicts)
    stages: list[list[dict]] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    text: str = ""
    # incremental detokenisation offsets into the output ids (see llm_engine._detokenize)
    prefix_offset: int = 0
    read_offset: int = 0
    # speculative decoding: the last num_draft_tokens of token_ids are proposals awaiting verification
    num_draft_tokens: int = 0
    spec_k: int | None = None  # the drafts its next step may propose under a "heuristic" schedule (None: k)
    spec_seed: int = 0  # keys the sampling noise of each position (spec_decode); the request's seed if set
    # [num_draft_tokens, vocab] the draft model's q_t per pending draft (None: n-gram, a point mass); verification
    # needs none (coupled), the draft checks do (spec_decode.draft_checks)
    draft_probs: torch.Tensor | None = None
    spec_marks: list[str] | None = None  # per generated token, see CompletionOutput.spec_marks
    draft_checks: list[dict | None] | None = None  # per generated token, see CompletionOutput.drafts
    grammar: GrammarState | None = None  # structured outputs: this stream's matcher (structured.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


class GroupSearch(Protocol):
    """What a request needs of its beam search (engine/beam.py's BeamSearch holds the rest of the state)."""

    done: bool


@dataclass
class SpecStats:
    proposer: str
    k: int
    steps: int = 0  # verification forwards (with at least one draft token)
    proposed: int = 0
    accepted: int = 0
    # per draft position i (0: the first token after the last verified one): steps that drafted a token there,
    # and steps that kept it (every draft before it kept too, so the rate falls with i); they sum to the totals
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.proposed_by_position = self.proposed_by_position or [0] * self.k
        self.accepted_by_position = self.accepted_by_position or [0] * self.k

    def add(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        # new lists, not in place: run_isolated undoes a failed batch by restoring a shallow copy of the fields
        pad = [0] * max(0, proposed - len(self.proposed_by_position))  # the engine-wide totals grow to any k
        self.proposed_by_position = [n + (i < proposed) for i, n in enumerate(self.proposed_by_position + pad)]
        self.accepted_by_position = [n + (i < accepted) for i, n in enumerate(self.accepted_by_position + pad)]

    def to_dict(self) -> dict:
        return {"proposer": self.proposer, "num_speculative_tokens": self.k, "steps": self.steps,
                "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
                "mean_accepted_length": self.accepted / self.steps if self.steps else None,
                "proposed_by_position": list(self.proposed_by_position),
                "accepted_by_position": list(self.accepted_by_position)}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    # params.prompt_logprobs set: [None] then one {id: log-prob} per prompt token scored so far (prompt_logprobs.py)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    forked: bool = False  # n > 1: the children were forked off the prompt
    beam: GroupSearch | None = None  # mode="beam": the search state (beam.BeamSearch); seqs are its live beams
    spec: SpecStats | None = None  # mode="speculative": proposal / acceptance counters

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs) and (self.forked or self.params.n == 1)
