"""The engine loop: requests in, one scheduled batch per step, new tokens out."""
import itertools
import time

import torch

from engine_service.engine.beam import BeamSearch
from engine_service.engine.block_manager import BlockManager
from engine_service.engine.config import EngineConfig
from engine_service.engine.model_runner import ModelRunner, set_threads
from engine_service.engine.models.loader import load_tokenizer, resolve_model
from engine_service.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine_service.engine.proposers import DraftModel
from engine_service.engine.sampler import SamplingBatch, process_logits, sample
from engine_service.engine.sampling_params import SamplingParams
from engine_service.engine.scheduler import Scheduler
from engine_service.engine.sequence import Request, Sequence
from engine_service.engine.spec_decode import SpecDecoder, SpecStats, execute_with_rows


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        set_threads(config.num_threads)
        model_dir = resolve_model(config.model, config.cache_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.runner = ModelRunner(config, model_dir)
        hf = self.runner.hf_config
        self.vocab_size = hf.vocab_size
        self.max_model_len = min(config.max_model_len or hf.max_position_embeddings, hf.max_position_embeddings)
        self.eos_token_ids = _eos_ids(hf, self.tokenizer, model_dir)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.num_steps = 0
        drafter = None
        if config.draft_model:
            draft_dir = resolve_model(config.draft_model, config.cache_dir)
            drafter = DraftModel(config, draft_dir, self.vocab_size, self.tokenizer, load_tokenizer(draft_dir))
        self.spec = SpecDecoder(drafter, self._sampling_batch)

    # ---- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        params.validate()
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            text, token_ids = prompt, self.tokenizer(prompt).input_ids
        else:
            text, token_ids = None, list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
                raise ValueError(f"prompt_token_ids: every id must be an int in [0, {self.vocab_size})")
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: every id must be below the vocabulary size {self.vocab_size}")
        if params.mode == "speculative" and params.proposer == "draft" and self.spec.drafter is None:
            raise ValueError("proposer: 'draft' needs an engine started with a draft model "
                             "(LLM(..., draft_model=NAME) or --draft-model NAME)")
        if params.mode == "beam" and params.beam_width > self.config.max_beam_width:
            raise ValueError(f"beam_width: {params.beam_width} is above this engine's max_beam_width "
                             f"({self.config.max_beam_width})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the model's context of {self.max_model_len} tokens")
        if -(-total // self.config.block_size) > self.block_manager.num_blocks:
            raise ValueError(f"max_tokens: {total} tokens need more KV blocks than the pool has "
                             f"({self.block_manager.num_blocks} x {self.config.block_size})")
        if params.mode == "beam":
            # worst case: the full prompt blocks shared, every beam's tail its own
            shared = len(token_ids) // self.config.block_size
            need = shared + params.beam_width * (-(-total // self.config.block_size) - shared)
            if need > self.block_manager.num_blocks:
                raise ValueError(f"beam_width: {params.beam_width} beams of {total} tokens may need {need} KV "
                                 f"blocks; the pool has {self.block_manager.num_blocks}")
        req = Request(request_id, text, token_ids, params)
        if params.mode == "beam":
            req.beam = BeamSearch(req, self._stop_ids(params))
        elif params.mode == "speculative":
            req.spec = SpecStats(params.proposer, params.num_speculative_tokens)
        seq = self._new_seq(req, list(token_ids), 0)
        if req.spec is not None:
            seq.spec_marks = []
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
        self.spec.propose(self.scheduler.running, self.max_model_len)
        batch = self.scheduler.schedule()
        self.spec.fit(batch)
        for seq in batch.preempted:  # a preempted beam group recomputes: its pending log-probs go
            if seq.request.beam is not None:
                seq.request.beam.pending.pop(seq.seq_id, None)
        if not batch.seqs:
            return []
        self.num_steps += 1
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
        num_rows = [1 + s.num_draft_tokens for s in batch.seqs]
        if max(num_rows) > 1:
            logits, rows = execute_with_rows(self.runner, batch, num_rows)
        else:
            logits, rows = self.runner.execute(batch)
        to_sample: list[tuple[Sequence, int]] = []
        beams: list[tuple[Sequence, int]] = []
        spec: list[tuple[Sequence, torch.Tensor]] = []
        for seq, n, row, k in zip(batch.seqs, batch.num_new_tokens, rows, num_rows):
            seq.num_computed_tokens += n
            if k > 1:
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
                    self.block_manager.fork(seq, child)
                    self.scheduler.add_running(child, after=seq)
                    to_sample.append((child, row))
            to_sample.append((seq, row))
        touched: dict[str, Request] = {}
        now = time.monotonic()
        if to_sample:
            out = sample(logits[[r for _, r in to_sample]], self._sampling_batch([s for s, _ in to_sample]))
            now = time.monotonic()
            for i, (seq, _) in enumerate(to_sample):
                top = None
                if out.top_ids is not None and seq.request.params.logprobs:
                    k = seq.request.params.logprobs
                    top = dict(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
                if seq.spec_marks is not None:
                    seq.spec_marks.append("target")
                self._append_token(seq, int(out.token_ids[i]), float(out.logprobs[i]), top, now)
                touched[seq.request.request_id] = seq.request
        if spec:
            for req in self._verify(spec, now):
                touched[req.request_id] = req
        if beams:
            for req in self._beam_step(logits, beams, now):
                touched[req.request_id] = req
        return [self._output(req) for req in touched.values()]

    def _verify(self, items: list[tuple[Sequence, torch.Tensor]], now: float) -> list[Request]:
        """Speculative sequences: keep the accepted drafts plus one target token; roll back the rest."""
        for seq, tokens, marks, logprobs in self.spec.verify_batch(items):
            self.block_manager.truncate(seq, seq.num_tokens + len(tokens) - 1)  # KV of the accepted drafts stays
            p = seq.request.params
            for token, mark, row in zip(tokens, marks, logprobs):
                top = None
                if p.logprobs:
                    values, ids = row.topk(p.logprobs)
                    top = dict(zip(ids.tolist(), values.tolist()))
                seq.spec_marks.append(mark)
                self._append_token(seq, token, float(row[token]), top, now)
                if seq.is_finished:
                    break
            if not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)
        return [seq.request for seq, _ in items]

    def _beam_step(self, logits: torch.Tensor, items: list[tuple[Sequence, int]], now: float) -> list[Request]:
        """Store each beam's next-token log-probs (HF: log_softmax, then the processors); step every beam
        request whose live beams all have theirs."""
        seqs = [s for s, _ in items]
        raw = logits[[r for _, r in items]].log_softmax(dim=-1)
        processed = process_logits(raw.clone(), self._sampling_batch(seqs))
        reqs: dict[str, Request] = {}
        for i, seq in enumerate(seqs):
            seq.request.beam.pending[seq.seq_id] = (processed[i], raw[i])
            reqs[seq.request.request_id] = seq.request
        stepped = []
        for req in reqs.values():
            if req.beam.ready(req):
                req.beam.step(req, self._fork_beam, self.scheduler.finish)
                req.first_token_time = req.first_token_time or now
                req.last_token_time = now
                stepped.append(req)
        return stepped

    def _fork_beam(self, parent: Sequence) -> Sequence:
        child = self._new_seq(parent.request, list(parent.token_ids), parent.index)
        child.cumulative_logprob, child.logprobs = parent.cumulative_logprob, list(parent.logprobs)
        self.block_manager.fork(parent, child)
        self.scheduler.add_running(child, after=parent)
        return child

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        ps = [s.request.params for s in seqs]
        penalised = any(p.repetition_penalty != 1.0 for p in ps)
        seen = None
        if penalised:
            width = max(s.num_tokens for s in seqs)
            seen = torch.tensor([s.token_ids + [-1] * (width - s.num_tokens) for s in seqs], dtype=torch.int64)
        banned = [sorted(self._stop_ids(p)) if s.num_output_tokens < p.min_tokens else [] for s, p in zip(seqs, ps)]
        return SamplingBatch(
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in ps]),
            top_k=torch.tensor([p.top_k for p in ps]),
            top_p=torch.tensor([p.top_p for p in ps]),
            min_p=torch.tensor([p.min_p for p in ps]),
            repetition_penalty=torch.tensor([p.repetition_penalty for p in ps]),
            seen_tokens=seen,
            banned_tokens=banned,
            generators=[s.generator for s in seqs],
            num_logprobs=max(p.logprobs or 0 for p in ps),
        )

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)

    def _append_token(self, seq: Sequence, token: int, logprob: float, top: dict | None, now: float) -> None:
        req, p = seq.request, seq.request.params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if p.logprobs is not None:
            seq.logprobs.append({**(top or {}), token: logprob})
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        delta = self._detokenize(seq)
        seq.text += delta
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens and token in self._stop_ids(p):
            self._finish(seq, "stop")
        elif n_out >= p.min_tokens and p.stop and self._hit_stop_string(seq, len(delta)):
            self._finish(seq, "stop")
        elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _hit_stop_string(self, seq: Sequence, delta_len: int) -> bool:
        longest = max(len(s) for s in seq.request.params.stop)
        window_start = max(0, len(seq.text) - delta_len - longest + 1)
        for stop in seq.request.params.stop:
            at = seq.text.find(stop, window_start)
            if at >= 0:
                seq.text = seq.text[:at]  # like vLLM: the stop string is not part of the output
                return True
        return False

    def _detokenize(self, seq: Sequence, flush: bool = False) -> str:
        """Incremental detokenisation: text is released once it no longer ends in a partial character."""
        ids = seq.output_token_ids
        decode = self.tokenizer.decode
        prefix = decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
        full = decode(ids[seq.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and (flush or not full.endswith("\ufffd")):
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
            return full[len(prefix):]
        return ""

    def _finish(self, seq: Sequence, reason: str) -> None:
        if reason != "stop" or not seq.request.params.stop:
            seq.text += self._detokenize(seq, flush=True)
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self._free_draft(seq)

    def _free_draft(self, seq: Sequence) -> None:
        if self.spec.drafter is not None:
            self.spec.drafter.free(seq)

    def _output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        if finished:
            req.finished_time = time.monotonic()
            self.requests.pop(req.request_id, None)
        metrics = _metrics(req)
        if req.beam is not None:
            outs = req.beam.outputs(req, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
            metrics.generated_tokens = max((len(o.token_ids) for o in outs), default=0)
        else:
            outs = [CompletionOutput(s.index, s.text, list(s.output_token_ids), s.cumulative_logprob,
                                     list(s.logprobs) if req.params.logprobs is not None else None, s.finish_reason,
                                     spec_marks=list(s.spec_marks) if s.spec_marks is not None else None)
                    for s in sorted(req.seqs, key=lambda s: s.index)]
        if req.spec is not None:
            metrics.spec = req.spec.to_dict()
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, metrics)

    def stats(self) -> dict:
        return {
            **self.block_manager.summary(),
            "block_size": self.config.block_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_requests": len(self.requests),
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            **{f"spec_{k}": v for k, v in self.spec.totals.to_dict().items() if k not in ("proposer", "num_speculative_tokens")},
            **(self.spec.drafter.summary() if self.spec.drafter is not None else {}),
        }


def _metrics(req: Request) -> RequestMetrics:
    generated = max((s.num_output_tokens for s in req.seqs), default=0)
    m = RequestMetrics(req.arrival_time, prompt_tokens=len(req.prompt_token_ids),
                       cached_prompt_tokens=req.num_cached_tokens, generated_tokens=generated)
    if req.first_scheduled_time is not None:
        m.queue_time = req.first_scheduled_time - req.arrival_time
    if req.first_token_time is not None:
        m.ttft = req.first_token_time - req.arrival_time
        if generated > 1:
            m.tpot = (req.last_token_time - req.first_token_time) / (generated - 1)
    if req.finished_time is not None:
        m.e2e = req.finished_time - req.arrival_time
    return m


def _eos_ids(hf_config, tokenizer, model_dir) -> set[int]:
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
