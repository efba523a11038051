"""Beam search inside the engine, with Hugging Face's semantics (generate(num_beams=W, do_sample=False)).

The live beams of a request are Sequences on the shared paged cache and decode in the same batch as
everything else. Once every live beam has its next-token log-probs (`pending`), one step of the search
runs: over all live beams, the best `num_candidates` continuations (2W, more with several stop tokens);
those among the top W that stop become finished hypotheses (scored by log-prob / length ** penalty);
the best W that do not stop are the next live beams. A beam that survives into several children is
forked (the children share all its blocks; the first write into the shared last block copies it);
a beam with no child is freed at once. Finished hypotheses are plain token lists: they hold no blocks.
Under a grammar (structured outputs) two rules are added, since an output cut at max_tokens is no valid document:
every beam whose grammar may end offers that ending as a hypothesis, top W or not, and hypotheses that ended the
grammar rank above those cut at max_tokens (docs/decoding.md, "Structured outputs").

The search also records its tree for the playground (`events`, drained with each output): every hypothesis it
keeps is a node (the prompt is node 0); a step adds a "fork" node per live beam it keeps (child of the beam it
grew from) and a "finish" node per hypothesis that ends, and "prunes" the beams left without a child and the
finished hypotheses pushed out of the best W. A few dicts per step: recorded for every beam request.
"""
from dataclasses import dataclass

import torch

from engine_service.engine.outputs import CompletionOutput
from engine_service.engine.sampler import entropy, entropy_topk_rows, topk_rows
from engine_service.engine.sequence import Request, Sequence


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated ids, the stop token included
    cumulative_logprob: float  # sum of the raw log-probs of token_ids
    score: float  # summed processed log-probs / len(token_ids) ** length_penalty (HF's sequences_scores)
    logprobs: list[dict[int, float]] | None
    finish_reason: str
    entropies: list[float] | None = None  # with logprobs: nats of the raw distribution each token came from
    masked: list[float | None] | None = None  # with logprobs and a grammar: the mass it removed per token
    node: int = 0  # its node in the beam tree (events)


class BeamSearch:
    def __init__(self, req: Request, stop_ids: set[int]):
        p = req.params
        self.width, self.length_penalty, self.early_stopping = p.beam_width, p.length_penalty, p.early_stopping
        self.max_tokens, self.num_logprobs = p.max_tokens, p.logprobs
        self.stop_ids = stop_ids
        self._stop_list = torch.tensor(sorted(stop_ids), dtype=torch.long)
        # under a grammar an output cut at max_tokens is not a valid document: endings rank first (_rank)
        self.constrained = p.structured_outputs is not None
        # HF keeps (1 + #stop tokens) * W candidates (at least 2W): then W of them never stop
        self.num_candidates = max(2, 1 + len(stop_ids)) * self.width
        self.scores = torch.zeros(1)  # per live beam (req.seqs order, best first): summed processed log-probs
        # seq_id -> (processed, raw) log-probs and the raw mass its grammar masked (None: no grammar)
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor, float | None]] = {}
        self.finished: list[Hypothesis] = []  # best first, at most W
        self.done = False
        self.num_steps = 0
        self.events: list[dict] = []  # the tree's changes since drain(), BeamEvent's fields (shared/protocol.py)
        self.nodes: dict[int, int] = {}  # seq_id of a live beam -> its node (absent: the root, 0)
        self._next_node = 1

    def ready(self, req: Request) -> bool:
        return not self.done and all(s.seq_id in self.pending for s in req.seqs)

    def step(self, req: Request, fork, drop) -> None:
        """One search step. fork(parent) -> a new running Sequence sharing the parent's blocks;
        drop(seq) frees a beam's blocks at once."""
        beams = list(req.seqs)  # fork() appends children to req.seqs
        assert beams and len(beams) == self.scores.numel() and self.ready(req)
        raw = torch.stack([self.pending[s.seq_id][1] for s in beams])
        # no processor changed a row (no temperature, penalties, top-k...): the processed rows are the raw ones
        unprocessed = all(self.pending[s.seq_id][0] is self.pending[s.seq_id][1] for s in beams)
        processed = raw if unprocessed else torch.stack([self.pending[s.seq_id][0] for s in beams])
        masked = [self.pending[s.seq_id][2] for s in beams]
        self.pending.clear()
        vocab = processed.shape[1]
        # the best candidates over all beams: each beam's own best first, then the best of those (the global top k
        # is among the rows' top k each): ~0.2 ms for W=4 on a 49k vocabulary instead of ~0.56 ms for one topk
        # over the W * vocab scores. A beam's score shifts its whole row, so its best are its raw row's best:
        # unprocessed rows take one topk for both the candidates and the top log-probs.
        k = min(self.num_candidates, vocab * len(beams))
        # with logprobs, each beam's row entropy (what its children's tokens were drawn from): one pass, W rows,
        # which for unprocessed rows also gives their top k
        want_entropy, ent = self.num_logprobs is not None, None
        if unprocessed:
            n = min(max(k, self.num_logprobs or 0), vocab)
            ent, values, ids = entropy_topk_rows(raw, n) if want_entropy else (None, *topk_rows(raw, n))
            tops = self._tops(raw, (values, ids))
            row_top, row_ids = values[:, :k] + self.scores[:, None], ids[:, :k]
        else:
            ent = entropy(raw) if want_entropy else None
            tops = self._tops(raw)
            row_top, row_ids = topk_rows(processed + self.scores[:, None], min(k, vocab))
        nats = ent.tolist() if ent is not None else [None] * len(beams)
        top, at = row_top.view(-1).topk(k)
        flat = (at // row_top.shape[1]) * vocab + row_ids.reshape(-1)[at]
        # a grammar (structured outputs) may allow fewer tokens than candidates: never continue a -inf one
        finite = int(torch.isfinite(top).sum())
        top, flat = top[:finite], flat[:finite]
        parents, tokens = (flat // vocab).tolist(), (flat % vocab).tolist()
        gen_len = beams[0].num_output_tokens + 1
        assert all(s.num_output_tokens + 1 == gen_len for s in beams), "beams of a request step together"
        stops = [t in self.stop_ids or gen_len >= self.max_tokens for t in tokens]
        penalised = top / gen_len ** self.length_penalty
        step, parent_nodes = self.num_steps, [self.nodes.get(s.seq_id, 0) for s in beams]
        ended = set()  # beams that ended with a stop token this step
        for i in range(min(self.width, len(tokens))):  # only the top W candidates may finish (HF)
            if stops[i]:
                b = parents[i]
                self._add_finished(beams[b], tokens[i], raw[b], float(penalised[i]), nats[b], masked[b],
                                   parent_nodes[b], step, tops[b])
                if tokens[i] in self.stop_ids:
                    ended.add(b)
        if self.constrained:
            self._offer_endings(beams, processed, raw, ended, gen_len, nats, masked, parent_nodes, step, tops)
        keep = [i for i in range(len(tokens)) if not stops[i]][:self.width]
        children: dict[int, list[int]] = {}
        for i in keep:
            children.setdefault(parents[i], []).append(i)
        new: dict[int, Sequence] = {}
        for b, seq in enumerate(beams):
            kids = children.get(b, [])
            for i in kids[1:]:  # fork before the parent moves on: the children share its blocks
                new[i] = fork(seq)
                self._extend(new[i], tokens[i], raw[b], nats[b], masked[b], tops[b])
            if kids:
                self._extend(seq, tokens[kids[0]], raw[b], nats[b], masked[b], tops[b])
                new[kids[0]] = seq
            else:
                self._event("prune", step, parent_nodes[b])
                self.nodes.pop(seq.seq_id, None)
                drop(seq)
        req.seqs = [new[i] for i in keep]
        for rank, i in enumerate(keep):
            seq = req.seqs[rank]
            self.nodes[seq.seq_id] = node = self._new_node()
            self._event("fork", step, node, parent_nodes[parents[i]], tokens[i], float(raw[parents[i], tokens[i]]),
                        float(top[i]), rank, list(seq.block_table))
        self.scores = top[keep]
        self.num_steps += 1
        if not keep or self._cannot_improve(gen_len):
            self.done = True
            for seq in req.seqs:
                self._event("prune", step, self.nodes.pop(seq.seq_id))
                drop(seq)

    def _offer_endings(self, beams: list[Sequence], processed: torch.Tensor, raw: torch.Tensor, ended: set[int],
                       gen_len: int, nats: list, masked: list, parent_nodes: list[int], step: int,
                       tops: list[dict[int, float]]) -> None:
        """Under a grammar: every beam whose grammar may end here (its mask allows a stop token) and which did not
        end among the top W also ends, as a finished hypothesis scored as any other. HF's top-W rule would drop
        it (a beam after a JSON document's last "}" may take only its stop token, often an unlikely one) and
        leave nothing but outputs cut at max_tokens; it holds no block, and it competes on score."""
        stops = processed[:, self._stop_list]  # [beams, #stop ids]: -inf where the mask forbids a stop token
        best, at = stops.max(dim=1)
        for b in range(len(beams)):
            if b in ended or not bool(torch.isfinite(best[b])):
                continue
            score = float(self.scores[b] + best[b]) / gen_len ** self.length_penalty
            self._add_finished(beams[b], int(self._stop_list[at[b]]), raw[b], score, nats[b], masked[b],
                               parent_nodes[b], step, tops[b])

    def drain(self) -> list[dict]:
        """The tree's changes since the last call."""
        events, self.events = self.events, []
        return events

    def _new_node(self) -> int:
        self._next_node += 1
        return self._next_node - 1

    def _event(self, kind: str, step: int, node: int, parent: int | None = None, token: int | None = None,
               logprob: float | None = None, score: float | None = None, rank: int | None = None,
               blocks: list[int] | None = None) -> None:
        self.events.append({"kind": kind, "step": step, "node": node, "parent": parent, "token_id": token,
                            "logprob": logprob if logprob is None or logprob > float("-inf") else None,
                            "score": score if score is None or score > float("-inf") else None, "rank": rank,
                            "blocks": blocks})

    def _cannot_improve(self, gen_len: int) -> bool:
        """HF's stopping rule once W hypotheses are finished: early_stopping=True stops at once; False and
        "never" stop when the best live beam cannot beat the worst finished one at the length HF assumes."""
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        length = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else gen_len
        best = self.scores[0] / length ** self.length_penalty
        return not bool(best > self.finished[-1].score)

    def _extend(self, seq: Sequence, token: int, raw: torch.Tensor, nats: float | None, masked: float | None,
                top: dict[int, float]) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += float(raw[token])
        if self.num_logprobs is not None:
            seq.logprobs.append({**top, token: float(raw[token])})
            seq.entropies.append(nats)
            if seq.grammar is not None:
                seq.masked.append(masked)

    def _tops(self, raw: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[dict[int, float]]:
        """Per beam row of raw log-probs, its top num_logprobs {id: log-prob}: one topk for all the rows (the
        children of a beam share their parent's), or the first columns of `top`, a wider one already taken."""
        if not self.num_logprobs:
            return [{} for _ in range(raw.shape[0])]
        values, ids = topk_rows(raw, self.num_logprobs) if top is None else top
        n = self.num_logprobs
        return [dict(zip(i[:n], v[:n])) for i, v in zip(ids.tolist(), values.tolist())]

    def _add_finished(self, parent: Sequence, token: int, raw: torch.Tensor, score: float, nats: float | None,
                      masked: float | None, parent_node: int, step: int, top: dict[int, float]) -> None:
        logprobs = entropies = masks = None
        if self.num_logprobs is not None:
            logprobs = parent.logprobs + [{**top, token: float(raw[token])}]
            entropies = parent.entropies + [nats]
            masks = parent.masked + [masked] if parent.grammar is not None else None
        hyp = Hypothesis(parent.output_token_ids + [token], parent.cumulative_logprob + float(raw[token]), score,
                         logprobs, "stop" if token in self.stop_ids else "length", entropies, masks,
                         self._new_node())
        self.finished.append(hyp)
        self.finished.sort(key=self._rank)  # stable: on a tie the earlier hypothesis stays ahead
        rank = next((r for r, h in enumerate(self.finished[:self.width]) if h is hyp), None)
        self._event("finish", step, hyp.node, parent_node, token, float(raw[token]), score, rank)
        for lost in self.finished[self.width:]:
            self._event("prune", step, lost.node)
        del self.finished[self.width:]

    def _rank(self, hyp: Hypothesis) -> tuple[bool, float]:
        """Best first: by score (HF); under a grammar, every hypothesis that ended it before any cut at max_tokens
        (a truncated document is invalid, however likely its tokens)."""
        return self.constrained and hyp.finish_reason == "length", -hyp.score

    def outputs(self, req: Request, decode) -> list[CompletionOutput]:
        """The n best: finished hypotheses once done, else the live beams (score as if they ended now)."""
        n = req.params.n
        if self.done:
            return [CompletionOutput(i, decode(h.token_ids), list(h.token_ids), h.cumulative_logprob, h.logprobs,
                                     h.finish_reason, h.score, entropies=h.entropies, masked=h.masked)
                    for i, h in enumerate(self.finished[:n])]
        outs = []
        for i, seq in enumerate(req.seqs[:n]):
            ids = seq.output_token_ids
            score = float(self.scores[i]) / max(1, len(ids)) ** self.length_penalty
            logprobs = list(seq.logprobs) if self.num_logprobs is not None else None
            entropies = list(seq.entropies) if self.num_logprobs is not None else None
            masked = list(seq.masked) if self.num_logprobs is not None and seq.grammar is not None else None
            outs.append(CompletionOutput(i, decode(ids), ids, seq.cumulative_logprob, logprobs, None, score,
                                         entropies=entropies, masked=masked))
        return outs
