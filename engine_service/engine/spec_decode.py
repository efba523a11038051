"""Speculative decoding, per request, inside the continuous batch.

Each step, every running speculative sequence that is decoding gets up to k draft tokens appended
(n-gram lookup or the draft model, see proposers.py). The scheduler then treats them like any other
tokens: the sequence computes 1 + k tokens in one forward over its paged cache (the multi-token path
of the attention metadata), and the target's logits at all 1 + k positions verify the drafts:

    p = target distribution, q = draft distribution (a point mass for n-gram proposals)
    for each draft x_i:  accept with probability min(1, p_i(x_i) / q_i(x_i))
                         on rejection: sample from norm(max(0, p_i - q_i)), stop
    all k accepted:      sample a bonus token from p_{k+1}

(Leviathan et al. 2023; Chen et al. 2023): the output follows p exactly. Greedy requests accept the
longest prefix equal to the target's argmax, then take the target's token. The KV of rejected drafts
is rolled back (BlockManager.truncate); the draft cache rolls back lazily in DraftModel._sync.
"""
from dataclasses import dataclass

import torch

from engine_service.engine.proposers import Context, DraftModel, ngram_propose
from engine_service.engine.sampler import process_logits
from engine_service.engine.scheduler import ScheduledBatch
from engine_service.engine.sequence import Sequence


@dataclass
class SpecStats:
    proposer: str
    k: int
    steps: int = 0  # verification forwards (with at least one draft token)
    proposed: int = 0
    accepted: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted

    def to_dict(self) -> dict:
        return {"proposer": self.proposer, "num_speculative_tokens": self.k, "steps": self.steps,
                "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
                "mean_accepted_length": self.accepted / self.steps if self.steps else None}


def verify(processed: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, greedy: bool,
           generator: torch.Generator | None) -> tuple[list[int], list[str]]:
    """processed [k+1, vocab]: the target's processed logits at the k+1 positions. Returns the tokens to
    append (accepted drafts + one target token) and their marks."""
    k = len(drafts)
    if greedy:
        target = processed.argmax(dim=-1).tolist()
        a = 0
        while a < k and drafts[a] == target[a]:
            a += 1
        return drafts[:a] + [target[a]], ["accepted"] * a + ["bonus" if a == k else "resampled"]
    p = processed.softmax(dim=-1)
    for i, x in enumerate(drafts):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(torch.rand((), generator=generator)) * q_x < float(p[i, x]):  # u < p/q
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # only by rounding: p == q there
            residual = p[i]
        token = int(torch.multinomial(residual, 1, generator=generator))
        return drafts[:i] + [token], ["accepted"] * i + ["resampled"]
    return drafts + [int(torch.multinomial(p[k], 1, generator=generator))], ["accepted"] * k + ["bonus"]


@torch.inference_mode()
def execute_with_rows(runner, batch: ScheduledBatch, num_rows: list[int]) -> tuple[torch.Tensor, list[int]]:
    """ModelRunner.execute, but sequence i gets logits for its last num_rows[i] tokens (when its chunk
    reaches its last token): rows index[i] .. index[i] + num_rows[i] - 1 of the returned logits."""
    runner.copy_blocks(batch.copies)
    input_ids, positions, meta, last_row = runner.prepare(batch)
    hidden = runner.forward(input_ids, positions, meta)
    rows, index = [], []
    for r, k in zip(last_row, num_rows):  # a sequence's tokens are contiguous in the flat batch
        index.append(len(rows) if r >= 0 else -1)
        if r >= 0:
            rows.extend(range(r - k + 1, r + 1))
    logits = runner.model.compute_logits(hidden[rows]) if rows else hidden.new_empty(0, 0).float()
    return logits, index


class SpecDecoder:
    def __init__(self, drafter: DraftModel | None, sampling_batch):
        self.drafter = drafter
        self.sampling_batch = sampling_batch  # contexts -> SamplingBatch (the engine's processors)
        self.totals = SpecStats("all", 0)
        self.drafted: list[Sequence] = []  # sequences given drafts this step, until fit()

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Append draft tokens to every running speculative sequence whose next step is a decode."""
        wanted = []
        for seq in running:
            p = seq.request.params
            if p.mode != "speculative" or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            assert seq.num_draft_tokens == 0
            # never past max_tokens: the step adds the accepted drafts plus one target token
            k = min(p.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                    max_model_len - seq.num_tokens)
            if k <= 0:
                continue
            if p.proposer == "ngram":
                self._attach(seq, ngram_propose(seq.token_ids, k, p.ngram_min, p.ngram_max), None)
            else:
                wanted.append((seq, k))
        if wanted:
            for (seq, _), (drafts, probs) in zip(wanted, self.drafter.propose(wanted, self.sampling_batch)):
                self._attach(seq, drafts, probs)

    def _attach(self, seq: Sequence, drafts: list[int], probs: torch.Tensor | None) -> None:
        if drafts:
            seq.token_ids += drafts
            seq.num_draft_tokens = len(drafts)
            seq.draft_probs = probs
            self.drafted.append(seq)

    def fit(self, batch: ScheduledBatch) -> None:
        """Drop the drafts the scheduler gave no room to: all of them for a sequence it did not schedule
        (budget, preemption), the tail beyond its chunk for one it scheduled in part."""
        scheduled = {id(s): n for s, n in zip(batch.seqs, batch.num_new_tokens)}
        for seq in self.drafted:
            keep = max(0, scheduled.get(id(seq), 0) - 1)  # the chunk starts at the last real token
            if keep < seq.num_draft_tokens:
                del seq.token_ids[seq.num_tokens - seq.num_draft_tokens + keep:]
                seq.num_draft_tokens = keep
                seq.draft_probs = seq.draft_probs[:keep] if seq.draft_probs is not None and keep else None
        self.drafted = []

    def verify_batch(self, items: list[tuple[Sequence, torch.Tensor]]) -> list[tuple[Sequence, list[int], list[str], torch.Tensor]]:
        """items: (sequence, its raw logits [1+k, vocab]); the sequence's drafts are removed from token_ids
        and its KV rolled back to the accepted ones. Returns (seq, tokens to append, marks, raw log-probs)."""
        contexts = []
        for seq, rows in items:
            base = seq.num_tokens - seq.num_draft_tokens
            contexts += [Context(seq.request, seq.token_ids[:base + j], seq.generator) for j in range(len(rows))]
        raw = torch.cat([rows for _, rows in items])
        processed = process_logits(raw.clone(), self.sampling_batch(contexts))
        logprobs = raw.log_softmax(dim=-1)
        out, start = [], 0
        for seq, rows in items:
            k = seq.num_draft_tokens
            drafts = seq.token_ids[seq.num_tokens - k:]
            tokens, marks = verify(processed[start:start + k + 1], drafts, seq.draft_probs,
                                   seq.request.params.greedy, seq.generator)
            accepted = len(tokens) - 1
            seq.request.spec.add(k, accepted)
            self.totals.add(k, accepted)
            del seq.token_ids[seq.num_tokens - k:]
            seq.num_draft_tokens, seq.draft_probs = 0, None
            out.append((seq, tokens, marks, logprobs[start:start + len(tokens)]))
            start += k + 1
        return out
