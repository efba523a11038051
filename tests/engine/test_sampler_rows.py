"""The sampler's per-row work (sampler.py): top-k / top-p / min-p run only on the rows that ask for them, and
top-k followed by top-p cuts inside the k largest logits instead of sorting the vocabulary. Both keep exactly
the tokens Hugging Face's processors keep, as does top-p alone without sorting the vocabulary. Rows that are all
plain greedy take one C pass inside sample() and get what the full sampler gives, alone or beside any other rows.
The row helpers that replace torch's slow CPU reductions (argmax_rows, topk_rows, finite_ids) give torch's answers."""
from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import TopKLogitsWarper, TopPLogitsWarper

from decodelab_kernels import cpu_logits
from engine_service import LLM, SamplingParams
from engine_service.engine import sampler
from engine_service.engine.sampler import (
    SamplingBatch,
    apply_top_p,
    apply_top_p_partial,
    argmax_rows,
    entropy,
    entropy_topk_rows,
    finite_ids,
    plain_rows,
    process_logits,
    sample,
    top_k_top_p_kept,
    topk_rows,
)


def batch(rows: list[dict]) -> SamplingBatch:
    def col(name, default, dtype=torch.float32):
        return torch.tensor([r.get(name, default) for r in rows], dtype=dtype)

    return SamplingBatch(temperature=col("temperature", 1.0), top_k=col("top_k", -1, torch.int64),
                         top_p=col("top_p", 1.0), min_p=col("min_p", 0.0), repetition_penalty=col("rp", 1.0),
                         seen_tokens=None, banned_tokens=[[] for _ in rows], generators=[None] * len(rows),
                         num_logprobs=0)


def hf(logits: torch.Tensor, row: dict) -> torch.Tensor:
    scores = logits[None] / row.get("temperature", 1.0)
    if row.get("top_k", -1) > 0:
        scores = TopKLogitsWarper(row["top_k"])(None, scores)
    if row.get("top_p", 1.0) < 1:
        scores = TopPLogitsWarper(row["top_p"])(None, scores)
    return scores[0]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 16), vocab=st.integers(2, 400),
       rows=st.lists(st.tuples(st.integers(-1, 450), st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 1e-4]),
                               st.sampled_from([0.3, 1.0, 1.7])), min_size=1, max_size=5))
def test_top_k_then_top_p_keep_the_tokens_hf_keeps(seed, vocab, rows):
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    cases = [dict(top_k=k, top_p=p, temperature=t) for k, p, t in rows]
    ours = process_logits(logits.clone(), batch(cases))
    for i, case in enumerate(cases):
        theirs = hf(logits[i], case)
        assert torch.equal(ours[i].isfinite(), theirs.isfinite()), case
        torch.testing.assert_close(ours[i][theirs.isfinite()], theirs[theirs.isfinite()])


def test_the_partial_cut_hands_ties_at_the_kth_logit_back():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])  # top-2 keeps the three 2.0s as well
    assert top_k_top_p_kept(logits, torch.tensor([2]), torch.tensor([0.9]))[3].tolist() == [True]  # tied
    ours = process_logits(logits.clone(), batch([dict(top_k=2, top_p=0.9)]))
    assert torch.equal(ours[0].isfinite(), hf(logits[0], dict(top_k=2, top_p=0.9)).isfinite())


def test_a_row_without_top_p_keeps_its_zero_probability_tokens_beside_a_top_p_row():
    # HF runs no top-p on a row with top_p=1; tokens whose probability underflows to 0 stay finite
    logits = torch.tensor([[0.0, -3.0, 1.0], [0.0, 1.0, 2.0]])
    cases = [dict(temperature=0.01), dict(top_p=0.5)]
    ours = process_logits(logits.clone(), batch(cases))
    assert ours[0].isfinite().all()
    assert torch.equal(ours[1].isfinite(), hf(logits[1], cases[1]).isfinite())


def test_greedy_rows_draw_no_noise():
    # the sampled row sees the same global-generator noise with or without greedy rows beside it
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    mixed_rows = batch([dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.0)])
    for seed in range(10):
        torch.manual_seed(seed)
        alone = sample(logits[1:2].clone(), batch([dict(temperature=1.0)])).token_ids
        torch.manual_seed(seed)
        mixed = sample(logits.clone(), mixed_rows).token_ids
        assert mixed[1] == alone[0]
        assert mixed[0] == logits[0].argmax() and mixed[2] == logits[2].argmax()


@pytest.mark.skipif(not cpu_logits.enabled(), reason=f"no C logit statistics: {cpu_logits.unavailable}")
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 16), rows=st.integers(1, 6), vocab=st.integers(1, 300), n=st.integers(0, 6),
       ties=st.booleans(), with_entropy=st.booleans())
def test_the_greedy_fast_path_gives_what_the_full_sampler_gives(seed, rows, vocab, n, ties, with_entropy):
    # ties (values on a coarse grid) and -inf logits included: the argmax goes to the lowest id, as torch's
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    if ties:
        logits = logits.round()
    logits[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")
    logits[:, 0] = logits[:, 0].clamp_min(-50.0)  # every row keeps a finite logit
    n = min(n, vocab)
    b = replace(batch([dict(temperature=0.0)] * rows), num_logprobs=n, entropy=with_entropy)
    assert plain_rows(b) == list(range(rows))
    full = sampler._sample_full(logits.clone(), b)
    fast = sample(logits.clone(), b)
    assert torch.equal(fast.token_ids, full.token_ids)
    assert torch.equal(fast.token_ids, logits.argmax(dim=1))
    assert torch.equal(fast.logprobs, full.logprobs)
    if n:
        assert torch.equal(fast.top_ids, full.top_ids) and torch.equal(fast.top_logprobs, full.top_logprobs)
    else:
        assert fast.top_ids is None and full.top_ids is None
    assert (fast.entropy is None) == (not with_entropy)
    if with_entropy:
        assert torch.equal(fast.entropy, full.entropy)


def seqs(params: list[SamplingParams], seed: int, outputs: int = 3) -> list[SimpleNamespace]:
    """Stand-ins for the engine's sequences (what SamplingBatch.of reads): 6 prompt tokens, `outputs` generated,
    a seeded generator per sampled row (so a row draws the same noise however the batch is split)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, p in enumerate(params):
        ids = torch.randint(0, 40, (6 + outputs,), generator=g).tolist()
        gen = torch.Generator().manual_seed(seed + i) if p.temperature > 0 else None
        out.append(SimpleNamespace(request=SimpleNamespace(params=p), token_ids=ids, num_tokens=len(ids),
                                   num_output_tokens=outputs, generator=gen))
    return out


def stop_ids(params: SamplingParams) -> set[int]:
    return {0}


@pytest.mark.parametrize("change", [dict(temperature=0.7), dict(repetition_penalty=1.1), dict(presence_penalty=0.5),
                                    dict(frequency_penalty=0.5), dict(logit_bias={3: 5.0}),
                                    dict(sampler_stages=5, logprobs=5), dict(min_tokens=4)])
def test_a_row_that_anything_can_move_off_its_argmax_is_not_plain(change):
    params = [SamplingParams(temperature=0.0, max_tokens=8),
              SamplingParams(temperature=0.0, max_tokens=8, top_k=3, top_p=0.5, min_p=0.2, logprobs=5),
              SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **change})]
    assert plain_rows(SamplingBatch.of(seqs(params, 0), stop_ids)) == [0, 1]
    if "min_tokens" in change:  # the ban on stop tokens ends once min_tokens are out
        assert plain_rows(SamplingBatch.of(seqs(params, 0, outputs=4), stop_ids)) == [0, 1, 2]
    # a grammar's masks are laid out by row: a batch with one is not split
    assert plain_rows(replace(SamplingBatch.of(seqs(params[:2], 0), stop_ids), grammar=object())) == []


@pytest.mark.parametrize("change", [dict(top_k=-1), dict(top_k=60), dict(temperature=0.0), dict(min_p=0.1),
                                    dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(logit_bias={3: 5.0}),
                                    dict(sampler_stages=5, logprobs=5), dict(min_tokens=4)])
def test_a_row_that_anything_but_temperature_top_k_and_top_p_acts_on_is_not_cut(change):
    params = [SamplingParams(temperature=0.8, top_k=5, max_tokens=8),
              SamplingParams(temperature=1.0, top_k=59, top_p=0.5, logprobs=5, max_tokens=8),
              SamplingParams(**{"temperature": 0.7, "top_k": 5, "max_tokens": 8, **change})]
    assert sampler.cut_rows(SamplingBatch.of(seqs(params, 0), stop_ids), 60) == [0, 1]
    assert sampler.cut_rows(replace(SamplingBatch.of(seqs(params[:2], 0), stop_ids), grammar=object()), 60) == []


PLAIN = {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
         "presence_penalty": 0.0, "logit_bias": None, "min_tokens": 0, "sampler_stages": 0, "logprobs": None}
ROW = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.0, 0.8, 1.0]), "top_k": st.sampled_from([-1, 5, 5, 59, 60]),
    "min_p": st.sampled_from([0.0, 0.0, 0.2]),
    "top_p": st.sampled_from([1.0, 0.9]), "repetition_penalty": st.sampled_from([1.0, 1.0, 1.3]),
    "presence_penalty": st.sampled_from([0.0, 0.0, 0.5]), "logit_bias": st.sampled_from([None, None, {3: 5.0}]),
    "min_tokens": st.sampled_from([0, 0, 5]), "sampler_stages": st.sampled_from([0, 0, 3]),
    "logprobs": st.sampled_from([None, 0, 2])})


@pytest.mark.skipif(not cpu_logits.enabled(), reason=f"no C logit statistics: {cpu_logits.unavailable}")
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 16), rows=st.lists(ROW, min_size=1, max_size=6), ties=st.booleans())
@example(seed=1718, ties=True, rows=[  # a tie in a traced row's top 3 after top-k, once reported in either order
    {**PLAIN, "top_k": 5, "sampler_stages": 3}, PLAIN, {**PLAIN, "top_p": 0.9},
    {**PLAIN, "temperature": 0.8, "top_k": 5, "top_p": 0.9}])
def test_a_batch_split_between_the_fast_path_and_the_processors_gives_each_row_its_own(seed, rows, ties):
    # the split (plain rows in C, cut rows among their k largest, the rest through the processors, merged back)
    # against every row through the processors: the same tokens (the same noise drawn), log-probs, top-N,
    # entropies and pipelines, bit for bit
    params = [SamplingParams(max_tokens=8, **r) for r in rows]
    logits = torch.randn(len(rows), 60, generator=torch.Generator().manual_seed(seed)) * 3
    if ties:
        logits = logits.round()
    split = sample(logits.clone(), SamplingBatch.of(seqs(params, seed), stop_ids))
    full = sampler._sample_full(logits.clone(), SamplingBatch.of(seqs(params, seed), stop_ids))
    for name in ("token_ids", "logprobs", "top_ids", "top_logprobs", "entropy"):
        a, b = getattr(split, name), getattr(full, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert split.stages == full.stages


def test_the_engine_gives_the_same_outputs_with_the_fast_paths_or_without(tiny_llama_dir, monkeypatch):
    # plain greedy rows beside a seeded top-k / top-p row and a penalised greedy one: the batch is split between
    # the C pass, the cut rows' race and the processors, and every row gets what the processors alone give it
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, num_threads=1)
    prompts = ["Once upon a time", "The capital of France is", "Readability counts.", "def fibonacci(n):"]
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=12, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, top_k=5)]
    calls = []
    greedy_path, cut_path = sampler._sample_greedy, sampler._sample_cut
    monkeypatch.setattr(sampler, "_sample_greedy", lambda *a: calls.append("greedy") or greedy_path(*a))
    monkeypatch.setattr(sampler, "_sample_cut", lambda *a: calls.append("cut") or cut_path(*a))
    fast = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert {"greedy", "cut"} <= set(calls) or not cpu_logits.enabled()
    monkeypatch.setattr(sampler, "plain_rows", lambda b: [])  # every row of every step through the processors
    monkeypatch.setattr(sampler, "cut_rows", lambda b, vocab: [])
    full = [o.outputs[0] for o in llm.generate(prompts, params)]
    for a, b in zip(fast, full):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob
    alone = [llm.generate([p], [sp])[0].outputs[0] for p, sp in zip(prompts, params)]  # each row its own batch
    assert [a.token_ids for a in fast] == [a.token_ids for a in alone]


def test_greedy_rows_behind_beams_sample_their_own_logits(tiny_llama_dir):
    # the beams' rows come first in the step's logits, so the sampled rows start past row 0 (LLMEngine._sample
    # takes consecutive rows as a view: it must start at theirs)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, num_threads=1)
    prompts = ["Once upon a time", "The capital of France is", "Readability counts."]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    params = [SamplingParams(mode="beam", beam_width=3, max_tokens=10, ignore_eos=True), greedy, greedy]
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts[1:], together[1:]):
        assert out.outputs[0].token_ids == llm.generate([prompt], [greedy])[0].outputs[0].token_ids


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2 ** 16), vocab=st.integers(2, 3000), rows=st.integers(1, 4),
       top_p=st.sampled_from([0.99, 0.95, 0.9, 0.5, 0.1, 1e-4]), scale=st.sampled_from([0.2, 1.0, 3.0, 8.0]),
       first_k=st.sampled_from([1, 4, 64]), masked=st.booleans(), c_kernel=st.booleans())
def test_top_p_without_a_sort_keeps_the_tokens_hf_keeps(seed, vocab, rows, top_p, scale, first_k, masked, c_kernel):
    # flat rows (scale 0.2) reach the sort, peaked ones (8.0) stop at the first k; -inf logits as a grammar or
    # top-k leaves them; the k largest from the C kernel or from torch.topk
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    if masked:
        logits[torch.rand(rows, vocab, generator=g) < 0.5] = float("-inf")
        logits[:, 0] = logits[:, 0].clamp_min(-30.0)
    with mock.patch.object(cpu_logits, "applies", cpu_logits.applies if c_kernel else lambda x: False):
        ours = apply_top_p_partial(logits, torch.full((rows,), top_p), first_k=first_k)
    for i in range(rows):
        theirs = TopPLogitsWarper(top_p)(None, logits[i][None].clone())[0]
        assert torch.equal(ours[i].isfinite(), theirs.isfinite())
        assert torch.equal(ours[i][theirs.isfinite()], logits[i][theirs.isfinite()])
    assert torch.equal(ours, apply_top_p(logits, torch.full((rows,), top_p)))


ROW_VALUES = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("-inf"), float("inf"), float("nan")])


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 4).flatmap(lambda s: st.integers(1, 70).flatmap(
    lambda v: st.lists(st.lists(ROW_VALUES | st.floats(-5, 5, width=32), min_size=v, max_size=v), min_size=s,
                       max_size=s))))
def test_the_row_helpers_answer_as_torch(rows):
    x = torch.tensor(rows, dtype=torch.float32)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))  # the first maximum, a NaN first of all
    assert torch.equal(argmax_rows(x[0]), x[0].argmax())
    assert torch.equal(finite_ids(x[0]), x[0].isfinite().nonzero().flatten())
    clean = x.nan_to_num(nan=0.0, posinf=9.0).contiguous()  # logits: no NaN or +inf
    for n in {1, min(5, clean.shape[1]), clean.shape[1]}:
        values, ids = topk_rows(clean, n)
        want = clean.topk(n, dim=-1).values
        assert torch.equal(values, want)  # the same values, largest first
        assert torch.equal(clean.gather(1, ids), values)  # and ids that hold them
        assert all(len(set(r)) == n for r in ids.tolist())


def test_topk_rows_takes_torch_where_our_kernel_does_not_apply():
    x = torch.randn(2, 600)
    with mock.patch.object(cpu_logits, "enabled", return_value=False):
        assert torch.equal(topk_rows(x, 7)[1], x.topk(7, dim=-1).indices)
    assert torch.equal(topk_rows(x, 513)[0], x.topk(513, dim=-1).values)  # past the kernel's 512


@pytest.mark.parametrize("c_kernel", [True, False])
@pytest.mark.parametrize("n", [1, 5, 40])
def test_entropy_and_top_n_in_one_pass_are_the_two_passes_bits(c_kernel, n):
    # the beam step and speculative verification take both from one C pass; log-prob rows with -inf entries (a
    # grammar's) and ties
    g = torch.Generator().manual_seed(n)
    logits = (torch.randn(5, 3000, generator=g) * 3).round()
    logits[torch.rand(5, 3000, generator=g) < 0.3] = float("-inf")
    rows = logits.log_softmax(dim=-1)
    if c_kernel and not cpu_logits.enabled():
        pytest.skip(f"no C logit statistics: {cpu_logits.unavailable}")
    with mock.patch.object(cpu_logits, "enabled", return_value=c_kernel and cpu_logits.enabled()):
        ent, values, ids = entropy_topk_rows(rows, n)
        want_values, want_ids = topk_rows(rows, n)
        assert torch.equal(ent, entropy(rows))
    assert torch.equal(values, want_values) and torch.equal(ids, want_ids)


@pytest.mark.skipif(not cpu_logits.enabled(), reason=f"no C logit statistics: {cpu_logits.unavailable}")
@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2 ** 16), rows=st.lists(ROW, min_size=2, max_size=6), ties=st.booleans())
def test_a_row_draws_the_same_token_alone_as_in_any_batch(seed, rows, ties):
    # each row decides for itself how its top-k and top-p run (a tie across its k-th logit: the two steps), and its
    # cumulative sum runs over its own k: a batch-mate's ties or wider k cannot move its cut (with logits on a
    # coarse grid, ties everywhere, they did)
    params = [SamplingParams(max_tokens=8, **r) for r in rows]
    logits = torch.randn(len(rows), 60, generator=torch.Generator().manual_seed(seed)) * 3
    if ties:
        logits = (logits * 2).round() / 2
    together = sample(logits.clone(), SamplingBatch.of(seqs(params, seed), stop_ids))
    for i in range(len(rows)):
        alone = sample(logits[i:i + 1].clone(), SamplingBatch.of(seqs(params, seed)[i:i + 1], stop_ids))
        assert int(alone.token_ids[0]) == int(together.token_ids[i]), i
        assert torch.equal(alone.logprobs[0], together.logprobs[i])
