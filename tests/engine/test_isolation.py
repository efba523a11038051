"""One bad request ends alone: near-zero temperatures decode greedily, and a request whose sampling,
verification or beam step raises finishes with finish_reason "error" while the rest of the batch
goes on with the tokens it would have had alone."""
import os

import pytest

from engine_service import LLM, SamplingParams
from engine_service.engine import llm_engine, spec_decode
from engine_service.engine.beam import BeamSearch
from engine_service.engine.sampler import PENALISED_BOUND

THREADS = int(os.environ.get("OMP_NUM_THREADS", "0")) or None
PROMPT = {"prompt_token_ids": list(range(512))}  # every id: the n-gram proposer always has drafts
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
HEALTHY = {
    "greedy": GREEDY,
    "seeded": SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
    "spec-seeded": SamplingParams(mode="speculative", temperature=0.9, seed=6, max_tokens=12, ignore_eos=True),
    "beam": SamplingParams(mode="beam", beam_width=2, temperature=0, max_tokens=12, ignore_eos=True),
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=512, block_size=8, num_threads=THREADS)


@pytest.fixture(autouse=True)
def idle_engine(llm):
    yield
    for rid in list(llm.engine.requests):  # leave the shared engine idle whatever the test did
        llm.engine.abort(rid)


@pytest.fixture(scope="module")
def alone(llm):
    """Each healthy request's RequestOutput when it runs by itself."""
    return {name: llm.generate(PROMPT, p)[0] for name, p in HEALTHY.items()}


def run_beside_healthy(llm, bad: SamplingParams) -> dict:
    """Run `bad` in one batch with every healthy request; return the final RequestOutput of each by id."""
    engine = llm.engine
    for name, p in HEALTHY.items():
        engine.add_request(name, PROMPT["prompt_token_ids"], p)
    # last in the batch: the batched attempt draws for the others before it raises
    engine.add_request("bad", PROMPT["prompt_token_ids"], bad)
    finals = {}
    while engine.has_unfinished():
        finals.update({out.request_id: out for out in engine.step() if out.finished})
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    return finals


def assert_healthy_as_alone(finals: dict, alone: dict) -> None:
    for name in HEALTHY:
        assert finals[name].error is None
        assert [o.token_ids for o in finals[name].outputs] == [o.token_ids for o in alone[name].outputs], name


# ---- near-zero temperatures

@pytest.mark.parametrize("mode", ["sample", "speculative"])
def test_a_temperature_below_1e_5_decodes_greedily(llm, mode):
    tiny = SamplingParams(mode=mode, temperature=1e-38, max_tokens=12, ignore_eos=True)
    out = llm.generate(PROMPT, tiny)[0]
    assert out.outputs[0].token_ids == llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def test_a_near_zero_temperature_beside_others_leaves_them_as_alone(llm, alone):
    finals = run_beside_healthy(llm, SamplingParams(mode="speculative", temperature=1e-38, max_tokens=12,
                                                    ignore_eos=True))
    assert finals["bad"].outputs[0].token_ids == alone["greedy"].outputs[0].token_ids
    assert_healthy_as_alone(finals, alone)


# ---- a request that makes its step raise

# a penalty this small takes the request's seen positive logits to the penalty's bound (finite since session 36)
POISONED = SamplingParams(mode="speculative", temperature=1.0, repetition_penalty=1e-300, max_tokens=12,
                          ignore_eos=True)


@pytest.fixture
def strict_verify(monkeypatch):
    """A verifier that refuses POISONED's logits at the penalty's bound once it has drafts to check (as a
    rejection sampler's torch.multinomial refuses what it cannot draw from): by then the healthy speculative
    requests have drafts too."""
    real = spec_decode.verify

    def verify(processed, drafts, *args, **kwargs):
        if drafts and bool((processed >= PENALISED_BOUND).any()):
            raise RuntimeError("logits at the penalty's bound")
        return real(processed, drafts, *args, **kwargs)

    monkeypatch.setattr(spec_decode, "verify", verify)


def test_a_request_whose_verification_raises_ends_alone_with_an_error(llm, alone, strict_verify):
    finals = run_beside_healthy(llm, POISONED)
    assert finals["bad"].finished and finals["bad"].outputs[0].finish_reason == "error"
    assert "penalty's bound" in finals["bad"].error
    assert_healthy_as_alone(finals, alone)
    assert finals["spec-seeded"].metrics.spec == alone["spec-seeded"].metrics.spec  # the failed attempt not counted


def test_a_request_whose_sampling_raises_ends_alone_with_an_error(llm, alone, monkeypatch):
    real = llm_engine.sample

    def sample(logits, batch):  # top_k=13 marks the poisoned request; it raises after the seeded draws
        out = real(logits, batch)
        if bool((batch.top_k == 13).any()):
            raise RuntimeError("poisoned row")
        return out

    monkeypatch.setattr(llm_engine, "sample", sample)
    finals = run_beside_healthy(llm, SamplingParams(n=2, temperature=1.0, top_k=13, max_tokens=12, ignore_eos=True))
    assert [o.finish_reason for o in finals["bad"].outputs] == ["error", "error"]
    assert "poisoned row" in finals["bad"].error
    assert_healthy_as_alone(finals, alone)


def test_a_beam_request_whose_step_raises_ends_alone_with_an_error(llm, alone, monkeypatch):
    real = BeamSearch.step

    def step(self, req, fork, drop):
        if req.request_id == "bad" and self.num_steps == 3:
            raise RuntimeError("poisoned beam")
        return real(self, req, fork, drop)

    monkeypatch.setattr(BeamSearch, "step", step)
    finals = run_beside_healthy(llm, SamplingParams(mode="beam", beam_width=3, temperature=0, max_tokens=12,
                                                    ignore_eos=True))
    assert finals["bad"].outputs and all(o.finish_reason == "error" for o in finals["bad"].outputs)
    assert "poisoned beam" in finals["bad"].error
    assert_healthy_as_alone(finals, alone)


def test_the_engine_takes_new_requests_after_a_failed_one(llm, alone, strict_verify):
    assert run_beside_healthy(llm, POISONED)["bad"].error
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == alone["greedy"].outputs[0].token_ids
