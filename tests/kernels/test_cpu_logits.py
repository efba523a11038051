"""decodelab_kernels/cpu_logits.c against float64 references (log-sum-exp, entropy, the top n with their
log-probabilities), and the sampler on it against the sampler on PyTorch's ops."""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from decodelab_kernels import cpu_logits
from engine_service.engine import sampler
from engine_service.engine.sampler import SamplingBatch, sample

pytestmark = pytest.mark.skipif(cpu_logits.unavailable() is not None,
                                reason=f"no avx2 logit kernel here: {cpu_logits.unavailable()}")


def _reference(x: torch.Tensor, n: int):
    x64 = x.double()
    lse = x64.logsumexp(1)
    lp = x64 - lse[:, None]
    p = lp.exp()
    ent = -(p * lp.masked_fill(p == 0, 0)).sum(1)
    # the top n, ties to the lower id: a stable sort of the negated values
    order = torch.sort(-x64, dim=1, stable=True).indices[:, :n]
    return lse, ent, order, lp.gather(1, order)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 5), vocab=st.integers(1, 300), n=st.integers(0, 8), pad=st.integers(0, 9),
       scale=st.sampled_from([0.01, 1.0, 10.0, 60.0]), masked=st.floats(0, 0.9), ties=st.booleans(),
       seed=st.integers(0, 10_000))
@example(rows=8, vocab=49152, n=5, pad=0, scale=3.0, masked=0.0, ties=False, seed=0)  # SmolLM2, the four modes
def test_logit_stats_are_the_float64_ones(rows, vocab, n, pad, scale, masked, ties, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab + pad, generator=g)[:, :vocab] * scale  # rows `pad` apart: a strided view
    if ties:
        x = x.round()  # many equal values: the lower id comes first
    x = x.masked_fill(torch.rand(rows, vocab, generator=g) < masked, float("-inf"))  # a grammar's or top-k's cut
    if rows:
        x[:, 0] = x[:, 0].clamp_min(-1e30)  # every row keeps a finite logit
    n = min(n, vocab)
    lse, ent, ids, lp = cpu_logits.logit_stats(x, n)
    want_lse, want_ent, want_ids, want_lp = _reference(x, n)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(ent.double(), want_ent, rtol=1e-4, atol=1e-4)
    finite = want_lp > float("-inf")  # among -inf entries any order is right
    assert torch.equal(ids[finite], want_ids[finite])
    assert all(len(set(r)) == n and min(r, default=0) >= 0 for r in ids.tolist())  # n distinct ids, always
    assert torch.equal(lp == float("-inf"), ~finite)
    torch.testing.assert_close(lp.double()[finite], want_lp[finite], rtol=1e-5, atol=1e-5)
    for i in range(rows):  # a row alone: the same bits
        one = cpu_logits.logit_stats(x[i:i + 1], n)
        assert all(torch.equal(a[0], b[i]) for a, b in zip(one, (lse, ent, ids, lp)))


def test_a_batch_split_between_threads_gives_each_row_its_bits_alone():
    # from 2 rows of 49k the kernel's rows run on OpenMP's threads (parallel_min): with two of them, a 128-row batch
    # (as a 128-sequence decode step) gives each row what it gets alone
    x = torch.randn(128, 49152, generator=torch.Generator().manual_seed(3)) * 4
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = cpu_logits.logit_stats(x, 5)
    finally:
        torch.set_num_threads(threads)
    for i in range(0, 128, 9):
        one = cpu_logits.logit_stats(x[i:i + 1], 5)
        assert all(torch.equal(a[0], b[i]) for a, b in zip(one, batch))


def test_impossible_tokens_count_zero_in_the_entropy():
    x = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")] * 3])
    lse, ent, ids, lp = cpu_logits.logit_stats(x, 2)
    assert math.isclose(float(ent[0]), math.log(6), rel_tol=1e-6)
    assert ids.tolist() == [[0, 1]] and math.isclose(float(lp[0, 0]), -math.log(6), rel_tol=1e-6)


def _batch(cases: list[dict], num_logprobs: int) -> SamplingBatch:
    rows = len(cases)
    return SamplingBatch(
        temperature=torch.tensor([c.get("temperature", 0.0) for c in cases]),
        top_k=torch.tensor([c.get("top_k", -1) for c in cases]),
        top_p=torch.tensor([c.get("top_p", 1.0) for c in cases]),
        min_p=torch.zeros(rows), repetition_penalty=torch.ones(rows), seen_tokens=None,
        banned_tokens=[c.get("banned", []) for c in cases],
        generators=[torch.Generator().manual_seed(i) for i in range(rows)], num_logprobs=num_logprobs, entropy=True)


def test_the_sampler_gives_the_same_tokens_and_close_logprobs_on_both_paths(monkeypatch):
    """The playground's rows (greedy, seeded top-k / top-p sampling, a banned EOS) through sample() on the C
    statistics and on PyTorch's log_softmax, topk and entropy."""
    cases = [{}, {"temperature": 0.8, "top_k": 50, "top_p": 0.95}, {"temperature": 1.0}, {"banned": [3]}]
    logits = torch.randn(len(cases), 49152, generator=torch.Generator().manual_seed(1)) * 4
    ours = sample(logits.clone(), _batch(cases, 5))
    monkeypatch.setattr(cpu_logits, "enabled", lambda: False)
    theirs = sample(logits.clone(), _batch(cases, 5))
    assert torch.equal(ours.token_ids, theirs.token_ids) and torch.equal(ours.top_ids, theirs.top_ids)
    for a, b in ((ours.logprobs, theirs.logprobs), (ours.top_logprobs, theirs.top_logprobs),
                 (ours.entropy, theirs.entropy)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    row = logits[0].log_softmax(0)
    torch.testing.assert_close(sampler.entropy(row), theirs.entropy[0], rtol=1e-5, atol=1e-5)  # 1-D, as spec uses
