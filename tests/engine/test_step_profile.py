"""`step_breakdown` (engine_service/bench/step_profile.py): the parts add up to the step, and the engine is
left as it was."""
import pytest

from engine_service import LLM, SamplingParams
from engine_service.bench.step_profile import PARTS, step_breakdown
from engine_service.engine.attention import PagedAttention
from tests.helpers import GREEDY, random_prompt

FOUR_MODES = [SamplingParams(max_tokens=40, **GREEDY),
              SamplingParams(mode="beam", beam_width=4, n=3, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=0, max_tokens=40, ignore_eos=True),
              SamplingParams(mode="speculative", proposer="ngram", num_speculative_tokens=4, max_tokens=40,
                             **GREEDY)]


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_the_parts_add_up_to_the_step_and_the_engine_is_left_unwrapped(tiny_llama_dir, clock):
    engine = LLM(model=str(tiny_llama_dir)).engine
    prompt = random_prompt(10, seed=0) * 2
    out = step_breakdown(engine, [(f"r{i}", prompt, p) for i, p in enumerate(FOUR_MODES)], steps=6, clock=clock)
    assert out["steps"] == 6 and out["rows_per_step"] > 4
    assert all(out[f"{p}_ms"] >= 0 for p in PARTS if p not in ("rest", "model_rest"))
    assert out["linears_ms"] > 0 and out["attention_ms"] > 0 and out["sampler_ms"] > 0
    assert sum(out[f"{p}_ms"] for p in PARTS) == pytest.approx(out["step_ms"])
    assert not engine.has_unfinished()  # its requests were aborted
    model = engine.runner.model
    assert all(type(layer.self_attn.attn) is PagedAttention for layer in model.layers)
    assert not {"compute_logits"} & set(vars(model)) and not {"forward", "prepare"} & set(vars(engine.runner))
    assert not {"_sample", "_verify", "_beam_step"} & set(vars(engine))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_unknown_clock_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="clock"):
        step_breakdown(LLM(model=str(tiny_llama_dir)).engine, [], clock="gpu")
