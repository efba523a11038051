"""The one-call decoder stack for CPU decode steps (engine_service/engine/models/fused_decode.py): the tokens and
log-probs it gives are bit for bit the module path's (greedy, beam, sampling and speculative rows, Llama and Qwen2
with q/k/v biases, fp16 and fp32 KV caches), it runs every decode step it can take, and anything it cannot take runs
the module path."""
import pytest
import torch

from decodelab_kernels import cpu_int8
from engine_service import LLM, SamplingParams
from engine_service.engine.models.fused_decode import FusedDecode, kernels_missing
from tests.helpers import GREEDY, cpu_int8_build, random_prompt

# also where a run forces the PyTorch paths (DECODELAB_CPU_KERNELS=torch): there is no fused path to test
pytestmark = pytest.mark.skipif(kernels_missing() is not None, reason=str(kernels_missing()))

PARAMS = [SamplingParams(max_tokens=12, **GREEDY, logprobs=3),
          SamplingParams(max_tokens=12, mode="beam", beam_width=3, n=2, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=7, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=12, mode="speculative", proposer="ngram", num_speculative_tokens=3, **GREEDY,
                         logprobs=1)]


def outputs(llm: LLM, prompts: list[list[int]]) -> list:
    """Every request of PARAMS on every prompt, in one batch: ids, log-probs and the top log-probs per output."""
    requests = [{"prompt_token_ids": p} for p in prompts for _ in PARAMS]
    params = [p for _ in prompts for p in PARAMS]
    return [[(o.token_ids, o.cumulative_logprob, o.logprobs) for o in r.outputs]
            for r in llm.generate(requests, params)]


@pytest.mark.parametrize("kv", ["auto", "fp32"])  # auto: fp16 under int8 weights on a CPU (EngineConfig)
@pytest.mark.parametrize("build", ["avx2", cpu_int8_build("avx512-simde"), cpu_int8_build("avx512vnni-simde")])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_steps_give_the_module_paths_bits(arch, build, kv, tiny_llama_dir, tiny_qwen2_dir, monkeypatch):
    # <build>-simde: an AVX-512 build's source on SIMDe, where a CPU with those instructions has its own build
    if build.endswith("-simde"):
        monkeypatch.setitem(cpu_int8.KERNELS, build.removesuffix("-simde"), cpu_int8.KERNELS[build])
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", build.removesuffix("-simde"))
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    prompts = [random_prompt(9, seed=s) * 2 for s in range(3)]  # repeats give the n-gram proposer drafts
    fused_llm, module_llm = (LLM(model=str(model_dir), quantization="int8", kv_cache_dtype=kv) for _ in range(2))
    assert fused_llm.engine.runner.kv_cache.dtype == (torch.float16 if kv == "auto" else torch.float32)
    module_llm.engine.runner.model.fused_decode = False  # never tried: the module path for every step
    assert module_llm.engine.runner.model.layers[0].mlp.down_proj.int8.matrix.kernel is cpu_int8.KERNELS[build]
    runs = []
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a, run=FusedDecode.run: runs.append(a[0].shape[0])
                        or run(self, *a))
    fused = outputs(fused_llm, prompts)
    assert len(runs) >= 11 and max(runs) > 1  # every decode step, several rows at once (beams, drafts)
    calls = len(runs)
    assert outputs(module_llm, prompts) == fused and len(runs) == calls


def test_steps_it_cannot_take_run_the_module_path(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", "avx2")
    runs = []
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a, run=FusedDecode.run: runs.append(1) or run(self, *a))
    prompt = {"prompt_token_ids": random_prompt(9, seed=1)}
    params = SamplingParams(max_tokens=4, **GREEDY)
    for kwargs in (dict(), dict(quantization="int8", kv_cache_dtype="int8")):  # fp32 weights; an int8 KV cache
        llm = LLM(model=str(tiny_llama_dir), **kwargs)
        assert len(llm.generate(prompt, params)[0].outputs[0].token_ids) == 4
        assert llm.engine.runner.model.fused_decode is False and not runs
    llm = LLM(model=str(tiny_llama_dir), quantization="int8")
    llm.generate(prompt, params)
    assert isinstance(llm.engine.runner.model.fused_decode, FusedDecode) and len(runs) == 3  # not the prefill


def test_an_id_or_position_out_of_its_table_raises_as_the_module_path_does(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", "avx2")
    llm = LLM(model=str(tiny_llama_dir), quantization="int8")
    seen = []
    monkeypatch.setattr(FusedDecode, "run", lambda self, *a, run=FusedDecode.run: seen.append(a) or run(self, *a))
    llm.generate({"prompt_token_ids": random_prompt(9, seed=1)}, SamplingParams(max_tokens=2, **GREEDY))
    fused, (ids, positions, meta) = llm.engine.runner.model.fused_decode, seen[0]
    vocab, max_pos = fused.embed.shape[0], fused.cos_table.shape[0]
    for bad_ids, bad_positions in ((ids + vocab, positions), (ids - ids - 1, positions), (ids, positions + max_pos)):
        with pytest.raises(IndexError):  # (torch.embedding and the RoPE table lookup raise IndexError too)
            fused.run(bad_ids, bad_positions, meta)
    assert torch.equal(fused.run(ids, positions, meta), fused.run(ids, positions, meta))
