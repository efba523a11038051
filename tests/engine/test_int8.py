"""INT8 weights (`quantization="int8"`, engine_service/engine/models/int8_linear.py): the linears stay close to
fp32, rows do not depend on their batch, the smoothing folds leave the float model unchanged, and the engine's
greedy tokens agree with fp32 on most positions. fp32 itself stays token-exact with HF (test_greedy_vs_hf.py)."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from decodelab_kernels import cpu_int8
from engine_service import LLM, SamplingParams
from engine_service.engine.config import EngineConfig
from engine_service.engine.models.int8_linear import (
    HeadWeight,
    Int8Weight,
    RowSplitWeight,
    _fbgemm_error,
    generated_rows,
    int8_kernel,
    projection_kernels,
)
from engine_service.engine.models.packed_linear import Linear
from tests.helpers import GREEDY, cpu_int8_build, random_prompt

FBGEMM = _fbgemm_error()  # None, or why fbgemm does not run on this CPU
needs_fbgemm = pytest.mark.skipif(FBGEMM is not None, reason=f"no fbgemm here: {FBGEMM}")
AVX2 = cpu_int8.unavailable("avx2")  # None, or why decodelab_kernels/cpu_int8.c does not build or run here
needs_avx2 = pytest.mark.skipif(AVX2 is not None, reason=f"no avx2 int8 kernel here: {AVX2}")
AVX512 = cpu_int8.unavailable("avx512")  # None, or why (the instructions the CPU lacks) cpu_int8_avx512.c does not
VNNI = cpu_int8.unavailable("avx512vnni")  # the same for cpu_int8_vnni.c
AMX = cpu_int8.unavailable("amx")  # the same for its AMX build
SIMDE = cpu_int8.unavailable("avx512-simde")  # the AVX-512 source on SIMDe's portable intrinsics: on any x86 CPU
# "<build>-simde": the engine with DECODELAB_INT8_KERNEL=<build> as on a CPU that has it, its source on SIMDe (`ours`)
OURS = [pytest.param("avx2", marks=needs_avx2),
        *map(cpu_int8_build, ("avx512", "avx512vnni", "amx", "avx512-simde", "avx512vnni-simde", "amx-simde"))]
KERNELS = [pytest.param("fbgemm", marks=needs_fbgemm), *OURS, "dequant"]
BATCH_INVARIANT = [pytest.param("fbgemm", marks=needs_fbgemm), *OURS]
# ||int8 - fp32|| / ||fp32|| on random N(0, 1) inputs and weights: 7-bit weights and 8-bit activations (fbgemm)
# measure ~0.9%, 8-bit weight-only (ours, dequant) ~0.4%; the bounds leave 2x.
REL_ERROR = {"fbgemm": 0.02, "dequant": 0.01} | dict.fromkeys(cpu_int8.KERNELS, 0.01)


def ours(kernel: str, monkeypatch) -> str:
    """The int8_linear kernel name for `kernel`; "<build>-simde" puts the SIMDe build where <build> goes and sets
    DECODELAB_INT8_KERNEL=<build>, so the engine runs as on a CPU that has it."""
    if not kernel.endswith("-simde"):
        return kernel
    build = kernel.removesuffix("-simde")
    monkeypatch.setitem(cpu_int8.KERNELS, build, cpu_int8.KERNELS[kernel])
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", build)
    return build


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_within_its_relative_error_of_fp32(kernel, rows, bias, monkeypatch):
    torch.manual_seed(rows)
    layer = Linear(256, 96, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
    want_w, want_b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(rows, 256)
    layer.quantize_int8(ours(kernel, monkeypatch))
    assert layer.weight.is_meta and layer.weight.shape == (96, 256)  # the float copy is gone
    got = layer(x)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert rel_error(got, F.linear(x, want_w, want_b)) < REL_ERROR[kernel]


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_linear_takes_empty_and_bf16_inputs(kernel, monkeypatch):
    w = Int8Weight(torch.randn(32, 64), torch.randn(32), ours(kernel, monkeypatch))
    assert w(torch.empty(0, 64)).shape == (0, 32)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert w(x).dtype == torch.bfloat16


@pytest.mark.parametrize("kernel", BATCH_INVARIANT)
def test_a_row_gives_the_same_int8_result_alone_or_in_any_batch(kernel, monkeypatch):
    # fbgemm: rows scaled to max |x| = 1 on one fixed grid; avx2: every output one dot product in a fixed order
    # whichever block of rows computes it. Either way a row's product does not depend on its neighbours
    torch.manual_seed(0)
    w = Int8Weight(torch.randn(130, 260), torch.randn(130), ours(kernel, monkeypatch))  # edges of the blocks
    rows = torch.randn(9, 260) * torch.tensor([1.0, 100.0, 0.01, 5.0, 1e3, 0.5, 2.0, 3.0, 0.1])[:, None]
    batched = w(rows)
    for i in range(9):
        assert torch.equal(w(rows[i:i + 1])[0], batched[i])
    assert torch.equal(w(rows[[4, 1]])[1], batched[1])
    assert torch.equal(w(rows[2:7])[3], batched[5])


@needs_fbgemm
def test_large_same_sign_activations_do_not_saturate_the_avx2_kernel():
    # AVX2 (no VNNI) adds pairs of uint8 x int8 products in int16: with 8-bit weights, 255 x 127 twice
    # overflows; with 7-bit weights it cannot. Every activation at the top of its grid (uint8 255), every
    # weight large and positive: the worst case.
    x = torch.full((2, 256), 3.0)
    weight = torch.rand(64, 256).add(0.9)
    got = Int8Weight(weight, None, "fbgemm")(x)
    assert rel_error(got, F.linear(x, weight)) < REL_ERROR["fbgemm"]


@needs_fbgemm
def test_the_fp16_head_matches_fp32_closely():
    torch.manual_seed(0)
    weight, x = torch.randn(500, 64), torch.randn(3, 64)
    assert rel_error(HeadWeight(weight)(x), F.linear(x, weight)) < 1e-3


def test_kernel_choice_and_its_switch(monkeypatch):
    for switch in ("DECODELAB_INT8_KERNEL", "DECODELAB_CPU_ISA"):  # the default, also in a run forcing a fallback
        monkeypatch.delenv(switch, raising=False)
    assert int8_kernel(torch.device("cuda")) == "dequant"
    # our kernel first: its grouped 8-bit weights and int16 activations keep the model's probabilities
    default = cpu_int8.default_isa() if cpu_int8.unavailable() is None else "fbgemm" if FBGEMM is None else "dequant"
    assert int8_kernel(torch.device("cpu")) == default
    assert default != "avx2" or AVX512 is not None  # the AVX-512 build where the CPU has it
    assert default != "avx512" or VNNI is not None  # the VNNI one where it has that too
    assert default != "avx512vnni" or AMX is not None  # and the AMX one where it has the tiles
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", "fbgemm")
    if FBGEMM is None:
        assert int8_kernel(torch.device("cpu")) == "fbgemm"
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", "dequant")
    assert int8_kernel(torch.device("cpu")) == "dequant"
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", "avx2")
    if AVX2 is None:
        assert int8_kernel(torch.device("cpu")) == "avx2"
    else:
        with pytest.raises(ValueError, match="avx2 does not run here"):
            int8_kernel(torch.device("cpu"))
    for build, why in (("avx512", AVX512), ("avx512vnni", VNNI), ("amx", AMX)):
        monkeypatch.setenv("DECODELAB_INT8_KERNEL", build)
        if why is None:
            assert int8_kernel(torch.device("cpu")) == build
        else:
            # names what the CPU lacks (or the generic switch, where a run forced it before the build was tried)
            with pytest.raises(ValueError, match=f"{build} does not run here.*(avx512|amx|generic)"):
                int8_kernel(torch.device("cpu"))
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", "int4")
    with pytest.raises(ValueError, match="DECODELAB_INT8_KERNEL"):
        int8_kernel(torch.device("cpu"))


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # GQA + tied head; q/k/v biases + untied head
def test_smoothing_folds_leave_the_float_model_unchanged(arch, tiny_llama_dir, tiny_qwen2_dir, monkeypatch):
    monkeypatch.setenv("DECODELAB_CPU_LINEAR", "dense")  # float weights the folds can scale in place
    runner = LLM(model=str(tiny_llama_dir if arch == "llama" else tiny_qwen2_dir), num_kv_blocks=16).engine.runner
    model = runner.model
    embedding = model.embed_tokens.weight.detach().clone()
    ids, positions, meta = runner.prefill_inputs(random_prompt(40, seed=1))
    with torch.inference_mode():
        before = model(ids, positions, meta)
    amax = model.input_absmax(ids, positions, meta)
    for layer in model.layers:
        layer.smooth(amax)
    assert not torch.equal(model.layers[0].input_layernorm.weight, torch.ones_like(embedding[0]))
    with torch.inference_mode():
        after = model(ids, positions, meta)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.embed_tokens.weight, embedding)  # a tied embedding stays float for the lookup


def greedy_and_teacher_forced(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy outputs, and the top-1 token at every prompt position (teacher forcing)."""
    params = SamplingParams(max_tokens=16, prompt_logprobs=1, **GREEDY)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    top1 = [[max(lp.items(), key=lambda kv: kv[1])[0] for lp in o.prompt_logprobs[1:]] for o in outs]
    return [o.outputs[0].token_ids for o in outs], top1


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for u, v in zip(a, b) for x, y in zip(u, v, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_engine_predicts_the_fp32_top_token_at_most_positions(kernel, arch, tiny_llama_dir, tiny_qwen2_dir,
                                                                   monkeypatch):
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", kernel)
    kernel = ours(kernel, monkeypatch)
    model = str(tiny_llama_dir if arch == "llama" else tiny_qwen2_dir)
    prompts = [random_prompt(48, seed=s) for s in range(4)]
    fp32_out, fp32_top = greedy_and_teacher_forced(LLM(model=model), prompts)
    llm = LLM(model=model, quantization="int8")
    layer = llm.engine.runner.model.layers[0]
    # on fbgemm: decode rows through the avx2 kernel, prefill rows of q/k/v and gate/up through fbgemm; o_proj,
    # down_proj and the head (the outlier-heavy inputs) avx2 for every row where it builds, else fbgemm / fp16
    # weights (int8_linear.projection_kernels)
    want = projection_kernels(kernel)
    for name, m in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                    ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
        assert isinstance(m.int8, HeadWeight) if want[name] == "fp16" else m.int8.kernel == want[name]
    head = llm.engine.runner.model.quantized_head
    assert isinstance(head, HeadWeight) if want["head"] == "fp16" else head.kernel == want["head"]
    if kernel == "fbgemm":
        ours_ = cpu_int8.default_isa()
        mix = (f"{ours_}|fbgemm", ours_, f"{ours_}|fbgemm", ours_, ours_) if AVX2 is None else (
            "fbgemm", "fbgemm", "fbgemm", "fp16", "fp16")  # no C compiler
        assert tuple(want.values()) == mix
    int8_out, int8_top = greedy_and_teacher_forced(llm, prompts)
    assert all(len(o) == 16 for o in int8_out)
    # measured on 4 x 47 positions: fbgemm 0.86 (llama) / 0.81 (qwen2), dequant 0.91 / 0.92; tiny random
    # models (64-wide) quantize worse than real ones (SmolLM2: 0.90 with fbgemm)
    assert agreement(int8_top, fp32_top) >= 0.75


def test_bf16_model_runs_int8(tiny_qwen2_dir):
    llm = LLM(model=str(tiny_qwen2_dir), dtype="bfloat16", quantization="int8")
    out = llm.generate({"prompt_token_ids": random_prompt(20, seed=4)}, SamplingParams(max_tokens=8, **GREEDY))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("kernel", BATCH_INVARIANT)
def test_int8_speculative_output_equals_int8_greedy(kernel, tiny_llama_dir, monkeypatch):
    # rows are batch-invariant, so verifying k drafts at once picks what one-token steps pick (with one
    # activation scale per step, as linear_dynamic has, 5 of 8 such prompts came out different)
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", kernel)
    ours(kernel, monkeypatch)
    llm = LLM(model=str(tiny_llama_dir), quantization="int8")
    prompts = [{"prompt_token_ids": random_prompt(12, seed=s) * 3} for s in range(4)]  # repeats: n-gram drafts
    greedy = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    spec = llm.generate(prompts, SamplingParams(max_tokens=24, mode="speculative", proposer="ngram",
                                                num_speculative_tokens=4, **GREEDY))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in greedy]
    assert sum(o.metrics.spec["proposed"] for o in spec) > 0


@pytest.fixture(scope="module")
def smollm2_scores(smollm2_dir):
    """fp32, default int8 weights, an int8 KV cache and (where SIMDe builds) int8 weights on the AVX-512 build on
    SmolLM2: the first 400 tokens of the prose held-out text and three lm-eval-style pairs
    (engine_service/bench/quality.py; the issue's worst one first)."""
    from engine_service.bench.quality import continuation_logliks, pair_tokens, quality_texts, text_scores

    runs = {}
    for quantization, kv in ((None, "auto"), ("int8", "auto"), (None, "int8"), ("int8-avx512-simde", "auto")):
        if quantization == "int8-avx512-simde":
            if SIMDE is not None:
                continue
            with pytest.MonkeyPatch.context() as mp:
                ours("avx512-simde", mp)
                llm = LLM(model=str(smollm2_dir), quantization="int8", num_kv_blocks=64)
                assert llm.engine.runner.model.layers[0].mlp.down_proj.int8.matrix.isa == "avx512"
        else:
            # the bounds are the default kernel's, also in a run with DECODELAB_INT8_KERNEL forced: the opt-in
            # fbgemm mix (8-bit prompt activations) is ~0.3 nats off here, its figures in bench quality
            with pytest.MonkeyPatch.context() as mp:
                mp.delenv("DECODELAB_INT8_KERNEL", raising=False)
                llm = LLM(model=str(smollm2_dir), quantization=quantization, kv_cache_dtype=kv, num_kv_blocks=64)
        text = {"prose": quality_texts(llm.tokenizer, ("prose.txt",))["prose.txt"][:400]}
        pairs = pair_tokens(llm.tokenizer, [("The largest planet is", " Jupiter"), ("The cat sat on the", " mat"),
                                            ("The capital of France is", " Paris")])
        key = quantization if kv == "auto" else f"kv_{kv}"
        runs[key] = text_scores(llm, text)["prose"], continuation_logliks(llm, pairs)
        if key == "int8":  # which decoder matrices run as 4-bit codes (none where our kernel is not the one)
            runs["int8_nibbles"] = [m.int8.matrix.nibbles for m in llm.engine.runner.model.layers.modules()
                                    if getattr(getattr(m, "int8", None), "matrix", None) is not None]
    return runs


@pytest.mark.slow
def test_int8_smollm2_runs_every_q4_1_decoder_weight_as_4_bit_codes(smollm2_scores):
    # all 120 are Q4_1 in the GGUF; a float `four_bit` check once left 115 of them 8-bit (twice the bytes a step)
    nibbles = smollm2_scores["int8_nibbles"]
    if not nibbles or os.environ.get("DECODELAB_INT8_NIBBLES") == "0":
        pytest.skip("our int8 kernel is not the one here, or DECODELAB_INT8_NIBBLES=0 keeps 8-bit codes")
    assert len(nibbles) == 120 and all(nibbles)


@pytest.mark.slow
def test_int8_smollm2_keeps_continuation_logliks_within_005_nats(smollm2_scores):
    # measured 0.017 / 0.022 / 0.001 (grouped 8-bit weights, int16 activations); per-row int8 with fbgemm's 8-bit
    # prompt activations, the default before, was 0.80 nats off on " Jupiter" (docs/kernels.md)
    fp32, int8 = smollm2_scores[None][1], smollm2_scores["int8"][1]
    assert max(abs(a - b) for a, b in zip(int8, fp32)) <= 0.05


@pytest.mark.slow
def test_int8_smollm2_keeps_perplexity_and_the_top_token_on_a_real_paragraph(smollm2_scores):
    (fp32, _), (int8, _) = smollm2_scores[None], smollm2_scores["int8"]
    ppl = [math.exp(-sum(s.logprobs) / len(s.logprobs)) for s in (fp32, int8)]
    assert ppl[1] / ppl[0] - 1 <= 0.005  # measured +0.16%
    assert agreement([int8.top1], [fp32.top1]) >= 0.97  # measured 99.5%


@pytest.mark.slow
@pytest.mark.skipif(SIMDE is not None, reason=f"no SIMDe build: {SIMDE}")
def test_int8_smollm2_on_the_avx512_build_keeps_the_same_bounds(smollm2_scores):
    # the AVX-512 build's format and integers are the AVX2 one's; its lanes add in another order (ulps)
    (fp32, fp32_pairs), (wide, wide_pairs) = smollm2_scores[None], smollm2_scores["int8-avx512-simde"]
    narrow = smollm2_scores["int8"][0]
    assert max(abs(a - b) for a, b in zip(wide_pairs, fp32_pairs)) <= 0.05
    ppl = [math.exp(-sum(s.logprobs) / len(s.logprobs)) for s in (fp32, wide, narrow)]
    assert ppl[1] / ppl[0] - 1 <= 0.005 and abs(ppl[1] / ppl[2] - 1) <= 1e-3
    assert agreement([wide.top1], [fp32.top1]) >= 0.97


@pytest.mark.slow
def test_int8_kv_cache_keeps_smollm2_perplexity_within_half_a_percent(smollm2_scores):
    (fp32, _), (kv, _) = smollm2_scores[None], smollm2_scores["kv_int8"]
    ppl = [math.exp(-sum(s.logprobs) / len(s.logprobs)) for s in (fp32, kv)]
    assert ppl[1] / ppl[0] - 1 <= 0.005  # measured +0.40% on these 400 tokens (AVX2 target)


@needs_fbgemm
@needs_avx2
def test_split_weight_sends_generated_rows_to_our_kernel_and_prompt_rows_to_fbgemm(tiny_llama_dir, monkeypatch):
    w, x = torch.randn(48, 64), torch.randn(7, 64)
    split = RowSplitWeight(w, None)
    token = generated_rows.set(3)
    try:
        got = split(x)
    finally:
        generated_rows.reset(token)
    # our kernel's build for this CPU: avx512vnni or avx512 where it has them (their lanes add in other orders)
    assert split.generated.kernel == cpu_int8.default_isa()
    assert torch.equal(got[:3], Int8Weight(w, None, cpu_int8.default_isa())(x[:3]))
    assert torch.equal(got[3:], Int8Weight(w, None, "fbgemm")(x[3:]))
    assert torch.equal(split(x), Int8Weight(w, None, "fbgemm")(x))  # outside a forward pass: no generated rows

    # in the engine: a 24-token prompt goes to fbgemm, its 4-token tail too when the rest is a cached prefix,
    # and every generated token (a decode row) to avx2
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", "fbgemm")
    llm = LLM(model=str(tiny_llama_dir), quantization="int8", block_size=4)
    llm.engine.runner.model.fused_decode = False  # the module path, whose calls are counted (test_fused_decode.py)
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj.int8
    seen = {"generated": [], "prompt": []}
    for kind in seen:
        inner = getattr(qkv, kind)
        monkeypatch.setattr(qkv, kind, lambda t, inner=inner, kind=kind: seen[kind].append(t.shape[0]) or inner(t))
    prompt = random_prompt(24, seed=5)
    params = SamplingParams(max_tokens=4, **GREEDY)
    first = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert seen == {"generated": [1, 1, 1], "prompt": [24]}
    again = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    # the cached prefix leaves a short tail (decode-shaped rows): still prompt rows, so the same K/V and tokens
    assert len(seen["prompt"]) == 2 and seen["prompt"][1] < 24 and again == first


@needs_fbgemm
def test_without_our_kernel_the_default_falls_back_to_fbgemm_and_fp16_weights(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(cpu_int8, "unavailable", lambda: "no C compiler (test)")
    assert projection_kernels("fbgemm") == {"qkv": "fbgemm", "o": "fbgemm", "gate_up": "fbgemm", "down": "fp16",
                                            "head": "fp16"}
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", "fbgemm")
    llm = LLM(model=str(tiny_llama_dir), quantization="int8")
    layer = llm.engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.int8.kernel == "fbgemm" and isinstance(layer.mlp.down_proj.int8, HeadWeight)
    assert isinstance(llm.engine.runner.model.quantized_head, HeadWeight)
    out = llm.generate({"prompt_token_ids": random_prompt(20, seed=6)}, SamplingParams(max_tokens=6, **GREEDY))
    assert len(out[0].outputs[0].token_ids) == 6
