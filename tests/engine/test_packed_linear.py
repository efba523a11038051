"""oneDNN-packed CPU linears: same math as F.linear, and the engine is token-exact either way."""
import pytest
import torch
import torch.nn.functional as F

from engine_service import LLM, SamplingParams
from engine_service.engine.models.packed_linear import Linear, bf16_packing_unavailable, packing_enabled

pytestmark = pytest.mark.skipif(not packing_enabled(torch.device("cpu"), torch.float32),
                                reason="PyTorch built without oneDNN")
NO_NATIVE_BF16 = bf16_packing_unavailable()  # None, or why not (the instructions this CPU lacks)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [0, 1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_dense(dtype, tol, rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, 200, bias=bias).to(dtype)
    dense_w = layer.weight.detach().clone()
    x = torch.randn(rows, 96, dtype=dtype)
    want = F.linear(x.float(), dense_w.float(), None if layer.bias is None else layer.bias.float())
    layer.pack()
    assert layer.weight.is_meta and layer.weight.shape == (200, 96)  # the dense copy is gone
    got = layer(x)
    assert got.shape == (rows, 200) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DECODELAB_CPU_LINEAR", "dense")
    assert not packing_enabled(torch.device("cpu"), torch.float32)
    monkeypatch.delenv("DECODELAB_CPU_LINEAR")
    assert packing_enabled(torch.device("cpu"), torch.float32)
    assert not packing_enabled(torch.device("cpu"), torch.float16)
    assert not packing_enabled(torch.device("meta"), torch.float32)


@pytest.mark.skipif(NO_NATIVE_BF16 is not None, reason=f"no native oneDNN bf16: {NO_NATIVE_BF16}")
def test_bf16_weights_pack_as_bf16_where_the_cpu_has_the_instructions():
    layer = Linear(32, 16).to(torch.bfloat16)
    layer.pack()
    assert layer.packed.dtype == torch.bfloat16


def test_bf16_weights_pack_as_float32_without_avx512(monkeypatch):
    monkeypatch.setenv("DECODELAB_CPU_ISA", "avx2")  # what an AVX2-only CPU (e.g. AMD Zen 3) gets
    assert "avx512bw" in bf16_packing_unavailable()
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    want = F.linear(x.float(), layer.weight.detach().float(), layer.bias.detach().float())
    layer.pack()
    assert layer.packed.dtype == torch.float32
    got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_unknown_cpu_isa_switch_is_an_error(monkeypatch):
    monkeypatch.setenv("DECODELAB_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="DECODELAB_CPU_ISA"):
        bf16_packing_unavailable()


@pytest.mark.parametrize("isa", ["", "avx2"])  # what this CPU supports, and the forced fallback
def test_bf16_engine_loads_and_generates_on_any_cpu(isa, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("DECODELAB_CPU_ISA", isa)
    llm = LLM(model=str(tiny_llama_dir), dtype="bfloat16")
    assert llm.engine.runner.model.layers[0].mlp.down_proj.packed is not None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, ignore_eos=True, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied head (packed copy) and untied lm_head
def test_engine_output_is_the_same_packed_or_dense(arch, tiny_llama_dir, tiny_qwen2_dir, monkeypatch):
    model_dir = str(tiny_llama_dir if arch == "llama" else tiny_qwen2_dir)
    prompts = [{"prompt_token_ids": list(range(5 + i, 5 + i + 7 * (i + 1)))} for i in range(4)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=16, logprobs=1)
    packed = LLM(model=model_dir, dtype="float32")
    layers = packed.engine.runner.model.layers
    assert layers[0].mlp.down_proj.packed is not None
    monkeypatch.setenv("DECODELAB_CPU_LINEAR", "dense")
    dense = LLM(model=model_dir, dtype="float32")
    assert dense.engine.runner.model.layers[0].mlp.down_proj.packed is None
    for a, b in zip(packed.generate(prompts, params), dense.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)


def test_row_counts_are_bucketed_so_onednn_caches_few_primitives():
    from engine_service.engine.models.packed_linear import _CHUNK, bucket_rows

    buckets = {bucket_rows(n) for n in range(1, _CHUNK + 1)}
    assert len(buckets) == 27 and max(buckets) == _CHUNK
    assert all(bucket_rows(n) == n for n in range(1, 9))
    assert all(n <= bucket_rows(n) < n + 16 for n in range(1, _CHUNK + 1))


@pytest.mark.parametrize("rows", [9, 63, 65, 255, 256, 257, 700])  # padded, exact, chunked + padded tail
def test_padded_and_chunked_rows_give_the_same_result(rows):
    torch.manual_seed(rows)
    layer = Linear(64, 48, bias=True)
    x = torch.randn(rows, 64)
    want = F.linear(x, layer.weight.detach(), layer.bias.detach())
    layer.pack()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
