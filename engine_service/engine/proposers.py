"""Draft proposers for speculative decoding.

- `ngram_propose`: prompt lookup, no model. The context's last n tokens (n from ngram_max down to
  ngram_min) are searched for earlier in the context; the tokens that followed the most recent match
  are the proposal. A point-mass draft distribution.
- `DraftModel`: a small model sharing the target's tokenizer, with its own ModelRunner (weights + KV
  pool) and BlockManager (block tables). Each target sequence has a `DraftSeq` mirror in the draft
  cache; before proposing, the mirror is cut back to the longest prefix it still shares with the
  target (rejected drafts roll back there), then k autoregressive draft steps run, batched over all
  sequences that asked for a proposal. A sampling request's draft at position t is argmax(q_t / E_t)
  with the noise E_t the target draws with at t (spec_decode: the coupling). It also returns each q_t
  (after the request's processors; a greedy request's at temperature 1): verification needs none, the
  draft checks (spec_decode.draft_checks) report q_t(x) and the residual max(0, p_t - q_t).
"""
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_service.engine.block_manager import BlockManager
from engine_service.engine.config import EngineConfig
from engine_service.engine.model_runner import ModelRunner
from engine_service.engine.sampler import SamplingBatch, position_noise, process_logits
from engine_service.engine.scheduler import ScheduledBatch
from engine_service.engine.sequence import Request, Sequence
from engine_service.engine.structured import GrammarState


def ngram_propose(token_ids: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the context's suffix."""
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(ngram_max, len(ids) - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every earlier n-gram
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return ids[start:start + k].tolist()
    return []


@dataclass
class Proposal:
    """A draft model's proposal for one sequence: its tokens and the distribution each was drawn from."""
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), vocab] q_t per drafted token (None when there are none)


@dataclass
class Context:
    """A sequence as seen at one sampling row (its token ids up to there): what the sampler needs."""
    request: Request
    token_ids: list[int]
    generator: torch.Generator | None
    grammar: GrammarState | None = None  # the sequence's matcher (accepted up to its own tokens, not the drafts)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_token_ids)


@dataclass(eq=False)
class DraftSeq:
    """A target sequence's mirror in the draft model's cache (the fields BlockManager and ModelRunner use)."""
    token_ids: list[int]
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModel:
    def __init__(self, config: EngineConfig, model_dir, target_vocab_size: int, target_tokenizer, tokenizer):
        if target_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"draft_model: {config.draft_model!r} has a different tokenizer vocabulary "
                             "from the target's; speculative decoding needs a shared tokenizer")
        self.runner = ModelRunner(config, model_dir)
        if self.runner.hf_config.vocab_size != target_vocab_size:
            raise ValueError(f"draft_model: vocabulary size {self.runner.hf_config.vocab_size} differs from the "
                             f"target's {target_vocab_size}")
        self.bm = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.seqs: dict[int, DraftSeq] = {}  # target seq_id -> mirror

    def free(self, seq: Sequence) -> None:
        mirror = self.seqs.pop(seq.seq_id, None)
        if mirror is not None:
            self.bm.free(mirror)

    def _sync(self, seq: Sequence) -> DraftSeq:
        mirror = self.seqs.setdefault(seq.seq_id, DraftSeq([], seq.num_prompt_tokens))
        # keep the longest computed prefix still shared with the target, and at least one token to compute
        valid = min(mirror.num_computed_tokens, len(seq.token_ids) - 1)
        if mirror.token_ids[:valid] != seq.token_ids[:valid]:
            valid = next(i for i, (a, b) in enumerate(zip(mirror.token_ids, seq.token_ids)) if a != b)
        if valid < mirror.num_computed_tokens:
            self.bm.truncate(mirror, valid)  # the tokens after `valid` were rejected drafts
        mirror.token_ids = list(seq.token_ids)
        return mirror

    @torch.inference_mode()
    def propose(self, items: list[tuple[Sequence, int]], sampling_batch) -> list[Proposal]:
        """Up to k draft tokens per (sequence, k), with their q rows. `sampling_batch(contexts)` builds the
        same processors the target applies."""
        mirrors = [self._sync(seq) for seq, _ in items]
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        active = list(range(len(items)))
        while active:
            batch, live = ScheduledBatch(), []
            for i in active:
                m = mirrors[i]
                if m.num_computed_tokens == 0 and not m.block_table:
                    self.bm.match_prefix(m)
                n = m.num_tokens - m.num_computed_tokens
                if not self.bm.can_allocate(m, n):  # the draft pool is full: propose what we have
                    self.bm.free(m)
                    continue
                batch.copies += self.bm.allocate(m, n)
                batch.seqs.append(m)
                batch.num_new_tokens.append(n)
                live.append(i)
            if not live:
                break
            logits, rows = self.runner.execute(batch)
            for m, n in zip(batch.seqs, batch.num_new_tokens):
                m.num_computed_tokens += n
                self.bm.cache_full_blocks(m)
            sb: SamplingBatch = sampling_batch([Context(items[i][0].request, mirrors[i].token_ids,
                                                        items[i][0].generator, items[i][0].grammar) for i in live])
            processed = process_logits(logits[rows], sb)
            q = processed.softmax(-1)  # one softmax for the batch: the race below and the draft checks share it
            for row, i in enumerate(live):
                seq, scores = items[i][0], processed[row]
                if not seq.request.params.greedy:  # the exponential race with the target's noise at this position
                    noise = position_noise(seq.spec_seed, mirrors[i].num_tokens, scores.shape[0])
                    scores = q[row] / noise.to(scores.device)
                token = int(scores.argmax())
                drafts[i].append(token)
                probs[i].append(q[row])
                mirrors[i].token_ids.append(token)
            active = [i for i in live if len(drafts[i]) < items[i][1]]
        return [Proposal(d, torch.stack(q) if q else None) for d, q in zip(drafts, probs)]

