"""The per-step roofline (engine_service/engine/roofline.py): the cost model counts what its docstring says, the
engine logs one record per step with the right prefill / decode split, and the roofs are measured quickly."""
import math
import time

from engine_service import LLM, SamplingParams
from engine_service.engine.roofline import Chunk, CostModel, ModelShape, engine_roofs, measure_roofs
from tests.helpers import GREEDY, random_prompt

# tests/tiny_models.py: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, intermediate 128, vocab 512
TINY = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512)
LAYER_PARAMS = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 256 + 128 * 64  # qkv, o, gate_up, down: 36,864


def run_to_end(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_the_tiny_models_weights_are_counted_as_stored(tiny_llama_dir):
    cost = LLM(str(tiny_llama_dir), num_kv_blocks=32).engine.cost
    assert cost.shape == TINY
    assert cost.layer_weight_bytes == 2 * LAYER_PARAMS * 4  # fp32 (oneDNN-packed), no biases
    assert cost.head_weight_bytes == 512 * 64 * 4  # the tied embedding, read as the head
    assert (cost.act_bytes, cost.kv_bytes) == (4, 4)


def test_int8_weights_and_an_int8_cache_are_counted_at_their_size(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("DECODELAB_INT8_KERNEL", "dequant")  # int8 everywhere, head included (int8_linear.py)
    cost = LLM(str(tiny_llama_dir), num_kv_blocks=32, quantization="int8", kv_cache_dtype="int8").engine.cost
    groups = LAYER_PARAMS // 32  # an fp32 step and offset per 32 weights (every in_features here is 64 or 128)
    assert cost.layer_weight_bytes == 2 * (LAYER_PARAMS + 8 * groups)
    assert cost.head_weight_bytes == 512 * 64 + 8 * 512 * 64 // 32
    assert cost.kv_bytes == 1 + 4 / 16  # plus its share of the (token, head) scale (head_dim 16)


def test_flops_and_bytes_of_a_mixed_step_are_the_hand_counted_ones():
    cost = CostModel(TINY, layer_weight_bytes=1000, head_weight_bytes=300, act_bytes=4, kv_bytes=4)
    # a 16-token prefill chunk from scratch (no logits yet) and a decode at context 21 (one logits row)
    chunks, rows = [Chunk(start=0, new=16, decode=0), Chunk(start=20, new=1, decode=1)], 1
    keys_seen = 16 * 17 // 2 + 21  # query at position p sees p + 1 keys
    assert cost.flops(chunks, rows) == (2 * 2 * LAYER_PARAMS * 17  # linears, 17 tokens
                                        + 4 * 16 * 4 * 2 * keys_seen  # QK^T and PV, 4 heads of 16, 2 layers
                                        + 2 * 64 * 512 * 1)  # the head, one row
    kv_per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x fp32
    linear_io = (64 + 128) + (64 + 64) + (64 + 256) + (128 + 64)  # in + out elements per token per layer
    assert cost.bytes(chunks, rows) == (1000 + 300  # the weights, once
                                        + kv_per_token * ((16 + 21) + 17)  # contexts read, new K/V written
                                        + 17 * 2 * linear_io * 4 + 17 * 64 * 4  # activations, embedding rows
                                        + 1 * 64 * 4 + 1 * 512 * 4)  # the head's input row and fp32 logits
    # no logits row: the head is not read at all
    assert cost.bytes(chunks[:1], 0) == cost.bytes(chunks[:1], 1) - 300 - 64 * 4 - 512 * 4


def test_chunked_prefill_is_logged_as_prefill_then_one_decode_token_a_step(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), num_kv_blocks=32, max_num_batched_tokens=16).engine
    before = time.time()
    engine.add_request("r", random_prompt(37, seed=0), SamplingParams(max_tokens=4, **GREEDY))
    run_to_end(engine)
    log = list(engine.step_log)
    # 16 + 16 + 5 prompt tokens (the last chunk samples the first token), then 3 decode steps
    assert [(r.prefill_tokens, r.decode_tokens) for r in log] == [(16, 0), (16, 0), (5, 0), (0, 1), (0, 1), (0, 1)]
    assert [r.step for r in log] == list(range(1, 7)) and all(r.request_ids == ["r"] for r in log)
    assert all(r.num_seqs == 1 and r.seconds > 0 and before <= r.start <= time.time() for r in log)
    decode = log[3]
    assert decode.flops == engine.cost.flops([Chunk(37, 1, 1)], 1)  # its context: the prompt and the first token


def test_speculative_verification_counts_its_draft_tokens_as_decode(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), num_kv_blocks=64).engine
    prompt = random_prompt(6, seed=3) * 4
    engine.add_request("s", prompt, SamplingParams(mode="speculative", proposer="ngram", num_speculative_tokens=3,
                                                   max_tokens=40, **GREEDY))
    spec = engine.requests["s"].spec
    run_to_end(engine)
    log = list(engine.step_log)
    assert (log[0].prefill_tokens, log[0].decode_tokens) == (len(prompt), 0)
    assert all(r.prefill_tokens == 0 and 1 <= r.decode_tokens <= 4 for r in log[1:])
    # each verification step: the newest real token plus the drafts it checks (the greedy loop gives n-gram matches)
    assert spec.proposed > 0 and sum(r.decode_tokens - 1 for r in log[1:]) == spec.proposed


def test_prefill_runs_at_a_higher_arithmetic_intensity_than_decode_and_batching_raises_decodes(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), num_kv_blocks=128).engine
    engine.add_request("alone", random_prompt(48, seed=1), SamplingParams(max_tokens=6, **GREEDY))
    run_to_end(engine)
    for i in range(6):  # then six at once: the same kind of decode step, six times the rows per weight read
        engine.add_request(f"b{i}", random_prompt(48, seed=10 + i), SamplingParams(max_tokens=6, **GREEDY))
    run_to_end(engine)
    log = list(engine.step_log)
    prefill = [r for r in log if r.decode_tokens == 0]
    decode = [r for r in log if r.prefill_tokens == 0]
    assert prefill and decode and len(prefill) + len(decode) == len(log)
    assert min(r.intensity for r in prefill) > max(r.intensity for r in decode)
    single = max(r.intensity for r in decode if r.num_seqs == 1)
    batched = min(r.intensity for r in decode if r.num_seqs == 6)
    assert batched > 3 * single
    assert {rid for r in log for rid in r.request_ids} == {"alone", *(f"b{i}" for i in range(6))}


def test_the_step_log_keeps_only_the_latest_steps(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), num_kv_blocks=32).engine
    engine.step_log = type(engine.step_log)(maxlen=3)
    engine.add_request("r", random_prompt(5, seed=0), SamplingParams(max_tokens=8, **GREEDY))
    run_to_end(engine)
    assert [r.step for r in engine.step_log] == [6, 7, 8]


def test_the_roofs_are_positive_finite_quick_and_measured_once_per_process():
    measure_roofs.cache_clear()
    began = time.perf_counter()
    roofs = measure_roofs(1)
    assert time.perf_counter() - began < 30.0  # ~0.6 s on the 2-core target: a guard against a runaway probe only
    assert roofs.kind == "float32" and roofs.threads == 1
    for value in (roofs.flops_per_s, roofs.bytes_per_s, roofs.ridge):
        assert math.isfinite(value) and value > 0
    assert roofs.flops_per_s > 1e9 and roofs.bytes_per_s > 1e9  # any CPU this runs on does better than 1 G/s
    assert measure_roofs(1) is roofs


def test_with_int8_weights_the_int8_linear_is_the_compute_roof():
    roofs = measure_roofs(1, int8_kernel="dequant")
    assert roofs.kind == "int8" and roofs.flops_per_s > 0 and roofs.matmul_flops_per_s > 0
    assert roofs.to_dict()["kind"] == "int8"


def test_bench_throughput_measures_int8_decode_against_the_int8_roof(tiny_llama_dir):
    from engine_service.bench.throughput import decode_roof

    assert decode_roof(LLM(str(tiny_llama_dir)), 123.0) == 123.0  # float weights: the GEMM peak it was given
    int8 = LLM(str(tiny_llama_dir), quantization="int8")
    assert decode_roof(int8, 123.0) == engine_roofs(int8.engine).flops_per_s / 1e9
    assert engine_roofs(int8.engine).kind == "int8"


def test_bench_batched_decode_times_steps_in_which_every_sequence_decodes(tiny_llama_dir):
    from engine_service.bench.throughput import batched_decode

    # a small step budget: the prompts prefill over 8 steps while the first ones to finish already decode
    llm = LLM(str(tiny_llama_dir), max_num_batched_tokens=32)
    model, rows = llm.engine.runner.model, []
    forward = model.forward
    model.forward = lambda ids, *a, **k: rows.append(ids.shape[0]) or forward(ids, *a, **k)
    res = batched_decode(llm, batch=4, context=60, steps=3)
    assert rows[-3:] == [4, 4, 4] and not llm.engine.has_unfinished()
    assert res["batch"] == 4 and 60 < res["mean_keys"] < 60 + 3 + 8 and res["tok_per_s"] > 0
