"""RoPE scaling (llama3, linear, yarn), configured the way real checkpoints' config.json do it: greedy tokens
equal HF transformers' in fp32, and the scaling changes those tokens (so a dropped branch would show)."""
import json

import pytest

from engine_service import LLM, SamplingParams
from tests.helpers import GREEDY, random_prompt
from tests.hf_oracle import assert_greedy_matches, hf_greedy
from tests.tiny_models import save_tiny_model

# The tiny models' rotary wavelengths (head_dim 16, theta 10000) run from 6 to ~20,000 positions; an original
# context of 64 puts them on both sides of every cut-off, so each scaling type takes all of its branches.
SCALINGS = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "linear": dict(type="linear", factor=4.0),  # the older key name, as in Llama 2 era configs
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
}
MAX_TOKENS = 24


def save_legacy_rope(out_dir, arch: str, rope_scaling: dict | None):
    """A tiny model whose config.json says `rope_theta` + `rope_scaling` (what checkpoints on the Hub carry)."""
    path = save_tiny_model(out_dir, arch, seed=3)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_theta=10000.0, rope_scaling=rope_scaling)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def unscaled_dirs(tmp_path_factory):
    return {arch: save_legacy_rope(tmp_path_factory.mktemp(f"{arch}-plain"), arch, None) for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("arch, scaling", [("llama", "llama3"), ("qwen2", "linear"), ("qwen2", "yarn"),
                                           ("llama", "yarn")])
def test_scaled_rope_greedy_tokens_match_hf(arch, scaling, tmp_path, unscaled_dirs):
    model_dir = save_legacy_rope(tmp_path, arch, SCALINGS[scaling])
    prompts = [random_prompt(n, seed=60 + n) for n in (40, 90)]  # decoding runs past the original 64 positions
    outs = LLM(str(model_dir), num_kv_blocks=64).generate([{"prompt_token_ids": p} for p in prompts],
                                                          SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))
    ours = [o.outputs[0].token_ids for o in outs]
    for prompt, tokens in zip(prompts, ours):
        assert_greedy_matches(model_dir, prompt, tokens, hf_greedy(model_dir, prompt, MAX_TOKENS))
    assert ours != [hf_greedy(unscaled_dirs[arch], p, MAX_TOKENS) for p in prompts]  # same weights, plain RoPE
