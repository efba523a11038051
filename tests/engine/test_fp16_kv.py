"""fp16 KV cache in the engine (`kv_cache_dtype="fp16"`, the default under int8 weights on a CPU): the C decode
attention and store (decodelab_kernels/cpu_decode_attention.c) reading and writing what PyTorch's paths read and write,
and SmolLM2's probabilities within a thousandth of a nat or so of the fp32 cache's (the pool's twice the blocks of fp32
and copy-on-write forks: test_int8_kv.py, beside the int8 cache's)."""
import pytest
import torch

from decodelab_kernels import cpu_decode_attention
from engine_service import LLM, SamplingParams
from tests.engine.test_int8_kv import PARAGRAPH
from tests.helpers import GREEDY, random_prompt


@pytest.mark.skipif(cpu_decode_attention.unavailable() is not None, reason=str(cpu_decode_attention.unavailable()))
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_c_kernels_and_pytorchs_paths_agree_on_an_fp16_cache(tiny_qwen2_dir, quantization, monkeypatch):
    """DECODELAB_CPU_KERNELS=torch: PyTorch's store (.half()) and its gather + SDPA over the same fp16 values; the C
    path (the one-call stack too, under int8 weights) rounds the same way and differs only in fp32 sums."""
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (5, 30, 70)]
    params = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    runs = {}
    for kernels in ("", "torch"):
        monkeypatch.setenv("DECODELAB_CPU_KERNELS", kernels)
        llm = LLM(str(tiny_qwen2_dir), kv_cache_dtype="fp16", quantization=quantization, block_size=8)
        assert llm.engine.runner.kv_cache.dtype == torch.float16
        runs[kernels] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for c, t in zip(runs[""], runs["torch"], strict=True):
        assert c.token_ids == t.token_ids
        assert c.cumulative_logprob == pytest.approx(t.cumulative_logprob, abs=1e-4)


@pytest.mark.slow
def test_fp16_kv_smollm2_keeps_the_fp32_caches_probabilities(smollm2_dir):
    """Teacher-forced over a real paragraph, then greedy: the prompt log-probs within 0.01 nats of the fp32 cache's
    (bench quality: the three texts' perplexities within 0.01%, continuations within 0.003 nats)."""
    params = SamplingParams(max_tokens=16, prompt_logprobs=0, **GREEDY)
    outs = {kv: LLM(model=str(smollm2_dir), kv_cache_dtype=kv, num_kv_blocks=32).generate(PARAGRAPH, params)[0]
            for kv in ("fp32", "fp16")}
    got, want = ([next(iter(lp.values())) for lp in outs[kv].prompt_logprobs[1:]] for kv in ("fp16", "fp32"))
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 0.01
    assert outs["fp16"].outputs[0].token_ids == outs["fp32"].outputs[0].token_ids
