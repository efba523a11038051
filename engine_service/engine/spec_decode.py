"""Speculative decoding, per request, inside the continuous batch.

Each step, every running speculative sequence that is decoding gets up to k draft tokens appended
(n-gram lookup or the draft model, see proposers.py). The scheduler then treats them like any other
tokens: the sequence computes 1 + k tokens in one forward over its paged cache (the multi-token path
of the attention metadata), and the target's logits at all 1 + k positions verify the drafts.

Verification couples the draft and the target through shared noise (Gumbel-max coupling; Daliri,
Musco and Suresh 2024, "drafter-invariant speculative decoding"):

    E_t = Exp(1) noise keyed by (the sequence's seed, position t)     sampler.position_noise
    y_t = argmax(p_t / E_t)    the target's token at t: the exponential race draws exactly from p_t
    x_t = argmax(q_t / E_t)    the draft model's proposal, same noise (n-gram: a lookup, no noise)
    keep the drafts while x_t == y_t; the first mismatch becomes y_t ("resampled");
    all k kept: y_{k+1} is the bonus

Every output token is a y_t, a draw from the target's p_t: the output follows p exactly. And y_t
depends only on (seed, position, context), never on how many drafts a step verified, so a seeded
request gives the same tokens whatever the batch, the token budget or the draft pool allowed (the
usual rejection sampler draws a different number of uniforms when the drafts are cut). The price: a
draft model's proposal is kept with probability >= (1 - TV) / (1 + TV) instead of 1 - TV (TV: the
total variation distance of p and q); an n-gram point mass x is kept with probability p(x) either way.
Greedy requests keep the longest prefix equal to the target's argmax, then take the target's token.
With structured outputs, p_t (and q_t) are masked by the grammar after the prefix and the drafts before t
(structured.masks), and drafts the grammar refuses are cut when proposed: the output is exactly a sample of
the constrained target.
The KV of rejected drafts is rolled back (BlockManager.truncate); the draft cache rolls back lazily
in DraftModel._sync.

Draft checks (`draft_checks`, shown by the playground): for each verified draft x_t, up to the first mismatch,
p_t(x) and q_t(x) (after the processors; n-gram: no q, a point mass), and what textbook rejection sampling
(Leviathan et al. 2023) would do with them: accept with min(1, p/q), else draw from max(0, p - q) renormalised.
`accepted` is what the coupling above did, so the two need not agree token by token; over many draws the
coupling keeps somewhat fewer (the bound above). A greedy target is a point mass on its argmax: acceptance 1 or
0, the residual that argmax alone.
"""
from dataclasses import dataclass

import torch

from engine_service.engine.proposers import Context, DraftModel, Proposal, ngram_propose
from engine_service.engine.sampler import argmax_rows, position_noise, process_logits
from engine_service.engine.scheduler import ScheduledBatch
from engine_service.engine.sequence import Sequence, SpecStats
from engine_service.engine.structured import masked_mass


def verify(processed: torch.Tensor, drafts: list[int], noise: torch.Tensor | None) -> tuple[list[int], list[str]]:
    """processed [k+1, vocab]: the target's processed logits at the k+1 positions; noise [k+1, vocab]:
    their Exp(1) noise (None: greedy, the argmax). Returns the tokens to append (the drafts equal to the
    target's own draws, then the target's token at the first mismatch or after the last draft) and their
    marks ("target" alone when there was no draft)."""
    target = argmax_rows(processed if noise is None else processed.softmax(dim=-1) / noise).tolist()
    k, a = len(drafts), 0
    while a < k and drafts[a] == target[a]:
        a += 1
    last = "target" if k == 0 else "bonus" if a == k else "resampled"
    return drafts[:a] + [target[a]], ["accepted"] * a + [last]


def target_noise(seq: Sequence, first: int, rows: torch.Tensor) -> torch.Tensor | None:
    """Exp(1) noise shaped like rows [num, vocab], for positions first .. first + num - 1 (None: greedy)."""
    if seq.request.params.greedy:
        return None
    num, vocab = rows.shape
    return torch.stack([position_noise(seq.spec_seed, first + i, vocab) for i in range(num)]).to(rows.device)


def next_draft_length(current: int, k: int, proposed: int, kept: int) -> int:
    """The "heuristic" schedule (HF assisted generation's num_assistant_tokens_schedule): a step that kept every
    draft it proposed lets the next propose 2 more, up to k; a rejection, 1 fewer, down to 1. Drafts a prompt
    lookup rarely gets right then cost one verification row a step instead of k (docs/decoding.md)."""
    return min(k, current + 2) if kept == proposed else max(1, current - 1)


RESIDUAL_TOP = 5  # residual tokens a check reports


@dataclass
class Verified:
    """One sequence's verification: the tokens to append, with their marks, raw log-prob rows and checks."""
    seq: Sequence
    tokens: list[int]
    marks: list[str]
    logprobs: torch.Tensor  # [len(tokens), vocab] raw log-probs of the rows the tokens were drawn at
    checks: list[dict | None]  # draft_checks
    masked: list[float | None]  # per token: the raw probability its grammar masked (structured.masked_mass)


def draft_checks(rows: torch.Tensor, drafts: list[int], q: torch.Tensor | None, tokens: list[int],
                 greedy: bool) -> list[dict | None]:
    """One check per appended token (CompletionOutput.drafts): rows [k+1, vocab] the target's processed
    logits, q [k, vocab] the draft model's distributions (None: n-gram), tokens what verify() appended.
    The accepted drafts and the first rejected one get a check, the bonus / target token None."""
    k, kept = len(drafts), len(tokens) - 1
    n = min(kept + 1, k)  # the drafts that were judged: the kept ones and the first mismatch
    if n == 0:
        return [None]
    x = torch.tensor(drafts[:n], device=rows.device)
    p = rows[:n].float().softmax(-1)
    point_mass = q is None
    q = torch.zeros_like(p).scatter_(1, x[:, None], 1.0) if point_mass else q[:n].to(p.device, p.dtype)
    p_x, q_x = p.gather(1, x[:, None])[:, 0], q.gather(1, x[:, None])[:, 0]
    if greedy:
        accept = (argmax_rows(rows[:n]).to(x.device) == x).to(p.dtype)
    else:
        accept = (p_x / q_x.clamp_min(torch.finfo(p.dtype).tiny)).clamp_max(1.0)
    checks: list[dict | None] = [
        {"position": i, "draft_token_id": drafts[i], "p_draft": None if point_mass else qi, "p_target": pi,
         "accept_prob": ai, "accepted": i < kept, "residual_token_id": None, "residual_top": []}
        for i, (pi, qi, ai) in enumerate(zip(p_x.tolist(), q_x.tolist(), accept.tolist()))]
    if kept < k:  # a rejection: the target's token, and the residual textbook rejection sampling redraws from
        y = tokens[kept]
        if greedy:
            top = [(y, 1.0)]
        else:
            residual = (p[kept] - q[kept]).clamp_min(0.0)
            total = float(residual.sum())
            values, ids = residual.topk(min(RESIDUAL_TOP, residual.shape[0]))
            top = [(i, v / total) for i, v in zip(ids.tolist(), values.tolist()) if v > 0] if total > 0 else []
        checks[kept].update(residual_token_id=y, residual_top=top)
    return checks + [None] * (len(tokens) - n)


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
            k = min(seq.spec_k or p.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                    max_model_len - seq.num_tokens)
            if k <= 0:
                continue
            if p.proposer == "ngram":
                self._attach(seq, Proposal(ngram_propose(seq.token_ids, k, p.ngram_min, p.ngram_max), None))
            else:
                wanted.append((seq, k))
        if wanted:
            for (seq, _), proposal in zip(wanted, self.drafter.propose(wanted, self.sampling_batch)):
                self._attach(seq, proposal)

    def _attach(self, seq: Sequence, proposal: Proposal) -> None:
        drafts = proposal.tokens
        if drafts and seq.grammar is not None:  # a draft the grammar refuses could never be kept: cut it here
            drafts = seq.grammar.valid_prefix(seq.output_token_ids, drafts)
        if drafts:
            seq.token_ids += drafts
            seq.num_draft_tokens = len(drafts)
            # kept as proposed: fit() and the grammar may cut the drafts, verify_batch reads the first k rows
            seq.draft_probs = proposal.probs
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
        self.drafted = []

    def verify_batch(self, items: list[tuple[Sequence, torch.Tensor]]) -> list[Verified]:
        """items: (sequence, its raw logits [1+k, vocab], k >= 0 drafts); every token of a speculative
        request comes out of here, so each is drawn with its position's noise. The drafts are removed from
        token_ids."""
        contexts = []
        for seq, rows in items:
            base = seq.num_tokens - seq.num_draft_tokens
            contexts += [Context(seq.request, seq.token_ids[:base + j], seq.generator, seq.grammar)
                         for j in range(len(rows))]
        raw = torch.cat([rows for _, rows in items])
        batch = self.sampling_batch(contexts)
        processed = process_logits(raw.clone() if batch.writes_logits else raw, batch)  # raw: for the log-probs
        logprobs = raw.log_softmax(dim=-1)
        masked = masked_mass(logprobs, batch.grammar) if batch.entropy else [None] * len(contexts)
        out, start = [], 0
        for seq, _ in items:
            k = seq.num_draft_tokens
            base = seq.num_tokens - k
            rows = processed[start:start + k + 1]
            drafts, greedy = seq.token_ids[base:], seq.request.params.greedy
            tokens, marks = verify(rows, drafts, target_noise(seq, base, rows))
            checks = draft_checks(rows, drafts, seq.draft_probs if k else None, tokens, greedy)
            if k:
                seq.request.spec.add(k, len(tokens) - 1)
                self.totals.add(k, len(tokens) - 1)
                p = seq.request.params
                if p.speculative_schedule == "heuristic":
                    seq.spec_k = next_draft_length(seq.spec_k or p.num_speculative_tokens, p.num_speculative_tokens,
                                                   k, len(tokens) - 1)
            # seq.draft_probs stays: a failed batch is re-run (isolation.py); the engine drops it after
            del seq.token_ids[base:]
            seq.num_draft_tokens = 0
            out.append(Verified(seq, tokens, marks, logprobs[start:start + len(tokens)], checks,
                                masked[start:start + len(tokens)]))
            start += k + 1
        return out
