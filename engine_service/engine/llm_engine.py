"""The engine loop: requests in, one scheduled batch per step, new tokens out."""
import itertools
import time
from collections import deque

import torch

from engine_service.engine.admission import EngineLimits, check_request
from engine_service.engine.beam import BeamSearch
from engine_service.engine.block_manager import BlockManager
from engine_service.engine.config import EngineConfig
from engine_service.engine.detokenizer import Detokenizer, eos_token_ids
from engine_service.engine.isolation import run_isolated
from engine_service.engine.model_runner import ModelRunner, set_threads
from engine_service.engine.models.loader import load_tokenizer, resolve_model
from engine_service.engine.outputs import RequestOutput, request_output
from engine_service.engine.prompt_logprobs import positions_to_score, score_prompt
from engine_service.engine.proposers import DraftModel
from engine_service.engine.roofline import CostModel, StepRecord, StepShape
from engine_service.engine.sampler import SamplingBatch, entropy, entropy_topk_rows, process_logits, sample
from engine_service.engine.sampling_params import SamplingParams
from engine_service.engine.scheduler import Scheduler
from engine_service.engine.sequence import Request, Sequence, SpecStats
from engine_service.engine.spec_decode import SpecDecoder
from engine_service.engine.stats import EngineStats
from engine_service.engine.structured import GrammarState, StructuredDecoding, masked_mass, masks


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        set_threads(config.num_threads)
        model_dir = resolve_model(config.model, config.cache_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.runner = ModelRunner(config, model_dir)
        hf = self.runner.hf_config
        self.vocab_size = hf.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = eos_token_ids(hf, self.tokenizer, model_dir)
        self.detok = Detokenizer(self.tokenizer, self._stop_ids)
        self.errors: dict[str, str] = {}  # request id -> why it failed this step (see isolation.py)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.cost = CostModel.of(self.runner)  # prices each step for the roofline (roofline.py)
        self.step_log: deque[StepRecord] = deque(maxlen=512)  # the latest steps, newest last
        drafter = None
        if config.draft_model:
            draft_dir = resolve_model(config.draft_model, config.cache_dir)
            drafter = DraftModel(config, draft_dir, self.vocab_size, self.tokenizer, load_tokenizer(draft_dir))
        self.spec = SpecDecoder(drafter, self._sampling_batch)
        self._structured: StructuredDecoding | None = None  # the grammar compiler, built for the first grammar
        self.limits = EngineLimits(self.vocab_size, self.max_model_len, config.block_size,
                                   self.block_manager.num_blocks, config.max_beam_width, drafter is not None)

    # ---- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        params.validate()
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        text, token_ids = check_request(prompt, params, self.tokenizer, self.limits)
        req = Request(request_id, text, token_ids, params)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token has no log-prob
        grammar = self._grammar(params)  # compiled (or cached) before anything is queued: ValueError if bad
        if params.mode == "beam":  # a beam whose grammar ended stops like one that drew a stop token
            req.beam = BeamSearch(req, self._stop_ids(params) | self._grammar_stop_ids(params))
        elif params.mode == "speculative":
            req.spec = SpecStats(params.proposer, params.num_speculative_tokens)
        seq = self._new_seq(req, list(token_ids), 0)
        seq.grammar = grammar
        if req.spec is not None:
            seq.spec_marks = []
            seq.draft_checks = []
            seq.spec_seed = params.seed if params.seed is not None else int(torch.randint(2 ** 62, ()))
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def _new_seq(self, req: Request, token_ids: list[int], index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), req, token_ids, index)
        if req.params.seed is not None:
            seq.generator = torch.Generator().manual_seed(req.params.seed + index)
        req.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
            self._free_draft(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step
    def step(self) -> list[RequestOutput]:
        began, t0 = time.time(), time.perf_counter()
        self.spec.propose(self.scheduler.running, self.max_model_len)
        batch = self.scheduler.schedule()
        self.spec.fit(batch)
        for seq in batch.preempted:  # a preempted beam group recomputes: its pending log-probs go
            if seq.request.beam is not None:
                seq.request.beam.pending.pop(seq.seq_id, None)
        if not batch.seqs:
            return []
        self.num_steps += 1
        shape = StepShape.of(batch)  # before the step moves its sequences on
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
        # rows per sequence, at the end of its chunk: prompt positions to score (prompt_logprobs.py), then, when
        # the chunk reaches its last token, the row it samples from and one per draft token to verify
        num_rows = [1 + s.num_draft_tokens for s in batch.seqs]
        scored = [positions_to_score(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
        ends = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(batch.seqs, batch.num_new_tokens)]
        logits, first = self.runner.execute(batch, [m + k * end for m, k, end in zip(scored, num_rows, ends)])
        rows = []
        for seq, m, i, end in zip(batch.seqs, scored, first, ends):
            if m:
                score_prompt(seq, logits[i:i + m])
            rows.append(i + m if end else -1)
        to_sample: list[tuple[Sequence, int]] = []
        beams: list[tuple[Sequence, int]] = []
        spec: list[tuple[Sequence, torch.Tensor]] = []
        for seq, n, row, k in zip(batch.seqs, batch.num_new_tokens, rows, num_rows):
            seq.num_computed_tokens += n
            if row >= 0 and seq.request.spec is not None:  # with or without drafts: keyed draws (spec_decode)
                spec.append((seq, logits[row:row + k]))
                continue
            self.block_manager.cache_full_blocks(seq)
            if row < 0:
                continue
            req = seq.request
            if req.beam is not None:
                beams.append((seq, row))
                continue
            if req.params.n > 1 and not req.forked:  # parallel sampling: children share the prompt's blocks
                req.forked = True
                for index in range(1, req.params.n):
                    child = self._new_seq(req, list(seq.token_ids), index)
                    child.grammar = seq.grammar.fork() if seq.grammar is not None else None
                    self.block_manager.fork(seq, child)
                    self.scheduler.add_running(child, after=seq)
                    to_sample.append((child, row))
            to_sample.append((seq, row))
        touched: dict[str, Request] = {}
        now = time.monotonic()
        if to_sample:
            sampled = run_isolated(to_sample, lambda items: self._sample(logits, items), self._fail)
            now = time.monotonic()
            for (seq, _), (token, logprob, top, ent, masked, stages) in sampled:
                if stages is not None:  # before the token: appending it may finish the sequence
                    seq.stages.append([s.to_dict() for s in stages])
                self._append_token(seq, token, logprob, top, now, ent, masked)
                touched[seq.request.request_id] = seq.request
        if spec:
            for req in self._verify(spec, now):
                touched[req.request_id] = req
        if beams:
            for req in self._beam_step(logits, beams, now):
                touched[req.request_id] = req
        touched.update((rid, self.requests[rid]) for rid in self.errors)
        outputs = [self._output(req) for req in touched.values()]
        self.step_log.append(self.cost.record(self.num_steps, began, time.perf_counter() - t0, shape, len(logits)))
        return outputs

    def _sample(self, logits: torch.Tensor, items: list[tuple[Sequence, int]]) -> list[tuple]:
        """(token, its log-prob, top {id: log-prob} or None, entropy or None, masked mass or None, its sampler
        pipeline or None) per item."""
        seqs = [s for s, _ in items]
        asked = [s.request.params.logprobs for s in seqs]
        rows = [r for _, r in items]
        first = rows[0]  # (run_isolated never passes an empty group)
        # consecutive rows (a decode batch's are) as a view: the gather would copy them (25 MB at 128 x 49k)
        picked = logits[first:first + len(rows)] if rows == list(range(first, first + len(rows))) else logits[rows]
        out = sample(picked, self._sampling_batch(seqs))
        ents = out.entropy.tolist() if out.entropy is not None else [None] * len(items)
        masked = out.masked or [None] * len(items)
        stages = out.stages or [None] * len(items)
        return [(*row, e if k is not None else None, m if k is not None else None, st)
                for row, e, m, k, st in zip(out.rows(asked), ents, masked, asked, stages)]

    def _verify(self, items: list[tuple[Sequence, torch.Tensor]], now: float) -> list[Request]:
        """Speculative sequences: keep the accepted drafts plus one target token; roll back the rest."""
        counters = [self.spec.totals] + [seq.request.spec for seq, _ in items]
        for _, v in run_isolated(items, self.spec.verify_batch, self._fail, counters):
            seq = v.seq
            seq.draft_probs = None  # the checks hold what they need of q: free the [k, vocab] rows
            self.block_manager.truncate(seq, seq.num_tokens + len(v.tokens) - 1)  # KV of the accepted drafts stays
            p = seq.request.params
            tops, ents = [None] * len(v.tokens), [None] * len(v.tokens)
            if p.logprobs:  # one pass for the step's rows: their entropies and top log-probs
                ent, values, ids = entropy_topk_rows(v.logprobs, p.logprobs)
                ents, tops = ent.tolist(), [dict(zip(i, x)) for i, x in zip(ids.tolist(), values.tolist())]
            elif p.logprobs is not None:
                ents = entropy(v.logprobs).tolist()
            chosen = v.logprobs.gather(1, torch.tensor(v.tokens)[:, None].to(v.logprobs.device))[:, 0].tolist()
            for token, mark, lp, check, masked, top, ent in zip(v.tokens, v.marks, chosen, v.checks, v.masked, tops,
                                                                ents):
                seq.spec_marks.append(mark)
                seq.draft_checks.append(check)
                self._append_token(seq, token, lp, top, now, ent, masked)
                if seq.is_finished:
                    break
            if not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)
        return [seq.request for seq, _ in items]

    def _beam_step(self, logits: torch.Tensor, items: list[tuple[Sequence, int]], now: float) -> list[Request]:
        """Store each beam's next-token log-probs (HF: log_softmax, then the processors); step every beam
        request whose live beams all have theirs."""
        reqs: dict[str, Request] = {}
        for (seq, _), pending in run_isolated(items, lambda group: self._beam_logprobs(logits, group), self._fail):
            seq.request.beam.pending[seq.seq_id] = pending
            reqs[seq.request.request_id] = seq.request
        stepped = []
        for req in reqs.values():
            if req.beam.ready(req):
                try:
                    req.beam.step(req, self._fork_beam, self.scheduler.finish)
                    for seq in req.seqs if not req.beam.done else []:
                        if seq.grammar is not None:
                            seq.grammar.sync(seq.output_token_ids)
                except Exception as e:  # this request alone ends (isolation.py)
                    self._fail(req, e)
                    continue
                req.first_token_time = req.first_token_time or now
                req.last_token_time = now
                stepped.append(req)
        return stepped

    def _beam_logprobs(self, logits: torch.Tensor, items: list[tuple[Sequence, int]]) -> list[tuple]:
        """(processed, raw) next-token log-probs per beam, and the raw mass its grammar masks (None: none)."""
        raw = logits[[r for _, r in items]].log_softmax(dim=-1)
        b = self._sampling_batch([s for s, _ in items])
        masked = masked_mass(raw, b.grammar) if b.entropy and b.grammar is not None else [None] * len(items)
        processed = process_logits(raw.clone() if b.writes_logits else raw, b)
        rows = list(raw)  # the same row objects twice when no processor applied (BeamSearch.step: one topk)
        return list(zip(rows if processed is raw else processed, rows, masked))

    def _fork_beam(self, parent: Sequence) -> Sequence:
        child = self._new_seq(parent.request, list(parent.token_ids), parent.index)
        # the parse state forks with the blocks: a deep copy at the parent's state, before either moves on
        child.grammar = parent.grammar.fork() if parent.grammar is not None else None
        child.cumulative_logprob, child.logprobs = parent.cumulative_logprob, list(parent.logprobs)
        child.entropies, child.masked = list(parent.entropies), list(parent.masked)
        self.block_manager.fork(parent, child)
        self.scheduler.add_running(child, after=parent)
        return child

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """Sequences or proposer Contexts -> their processors, with the grammar masks of constrained rows."""
        b = SamplingBatch.of(seqs, self._stop_ids)
        if any(s.grammar is not None for s in seqs):
            b.grammar = masks([(s.grammar, s.token_ids[len(s.request.prompt_token_ids):]) for s in seqs],
                              self.vocab_size)
        return b

    def _grammar(self, params: SamplingParams) -> GrammarState | None:
        if params.structured_outputs is None:
            return None
        if self._structured is None:
            self._structured = StructuredDecoding(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                                                  max(1, self.config.num_threads or 1))
        return self._structured.new_state(params.structured_outputs, self._grammar_stop_ids(params))

    def _grammar_stop_ids(self, p: SamplingParams) -> set[int]:
        """What a grammar ends on: the model's EOS, as in vLLM. A request's stop_token_ids stop its output where
        they are drawn, as without a grammar; made the grammar's stop tokens, they would take from it a token its
        text needs (stop_token_ids=[id of "x"] under `root ::= "x"...`: nothing allowed at the start)."""
        return set(self.eos_token_ids) if p.structured_outputs is not None else set()

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)

    def _append_token(self, seq: Sequence, token: int, logprob: float, top: dict | None, now: float,
                      nats: float | None = None, masked: float | None = None) -> None:
        req, p = seq.request, seq.request.params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if p.logprobs is not None:
            seq.logprobs.append({**(top or {}), token: logprob})
            if nats is not None:  # the entropy of the distribution it was drawn from
                seq.entropies.append(nats)
            if seq.grammar is not None:  # and what its grammar took away from that distribution
                seq.masked.append(masked)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        ended = False  # the grammar accepted its stop token: nothing may follow
        if seq.grammar is not None:
            seq.grammar.sync(seq.output_token_ids)
            ended = seq.grammar.terminated
        last = seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len or ended
        if self.detok.append(seq, last) or ended:
            self._finish(seq, "stop")
        elif last:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self._free_draft(seq)

    def _fail(self, req: Request, error: Exception) -> None:
        """End a request whose own input made its step raise; its unverified drafts are no output."""
        self.errors[req.request_id] = f"{type(error).__name__}: {error}"
        for seq in req.seqs:
            del seq.token_ids[seq.num_tokens - seq.num_draft_tokens:]
            seq.num_draft_tokens = 0
            if not seq.is_finished:
                self.scheduler.finish(seq)
            seq.finish_reason = "error"
            self._free_draft(seq)
        if req.beam is not None:
            req.beam.done = True

    def _free_draft(self, seq: Sequence) -> None:
        if self.spec.drafter is not None:
            self.spec.drafter.free(seq)

    def _output(self, req: Request) -> RequestOutput:
        error = self.errors.pop(req.request_id, None)
        finished = req.is_finished or error is not None
        if finished:
            req.finished_time = time.monotonic()
            self.requests.pop(req.request_id, None)
        return request_output(req, self.detok, finished, error)

    def stats(self) -> EngineStats:
        return EngineStats.of(self)

