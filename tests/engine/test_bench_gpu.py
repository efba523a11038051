"""`decodelab bench gpu` on the CPU: the speculative model, the refusal without a GPU, the synthetic step
inputs, the weight-byte count, and a --tiny smoke run through every section."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_service import LLMEngine
from engine_service.bench import spec_predict as sp
from engine_service.bench.gpu import synthetic_step, weight_bytes
from engine_service.cli import build_parser, main


def test_tokens_per_iteration_spans_one_to_k_plus_one():
    assert sp.tokens_per_iteration(0.0, 4) == 1
    assert sp.tokens_per_iteration(1.0, 4) == 5
    assert sp.tokens_per_iteration(0.5, 4) == 3


@pytest.mark.parametrize("alpha", [0.2, 0.6, 0.95])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_per_token_acceptance_inverts_the_iid_model(alpha, k):
    rate = (sp.iid_tokens_per_iteration(alpha, k) - 1) / k
    assert sp.per_token_acceptance(rate, k) == pytest.approx(alpha, abs=1e-9)
    assert sp.iid_tokens_per_iteration(alpha, k) == pytest.approx(sp.tokens_per_iteration(rate, k))


def test_speedup_charges_k_draft_steps_one_verify_and_host_overhead_per_forward():
    assert sp.speedup(3.0, 2, target_ms=10, draft_ms=0, verify_ms=10) == pytest.approx(3.0)
    # 3 tokens * (10 + 2) ms  /  (2 * 1 + 12 + 3 * 2) ms
    assert sp.speedup(3.0, 2, target_ms=10, draft_ms=1, verify_ms=12, overhead_ms=2) == pytest.approx(1.8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("flags", [[], ["--allow-cpu"], ["--tiny"]])
def test_bench_gpu_refuses_without_a_gpu_unless_allow_cpu_and_tiny(flags, capsys):
    assert main(["bench", "gpu", *flags]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@torch.inference_mode()
@pytest.mark.parametrize("q_len", [1, 5])
def test_synthetic_step_runs_the_model_and_writes_no_kv(tiny_llama_dir, q_len):
    runner = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=16, block_size=8).runner
    ids, pos, meta = synthetic_step(runner, q_len, context=37)
    assert meta.num_decode == (q_len == 1) and pos.tolist() == list(range(37 - q_len, 37))
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    hidden = runner.forward(ids, pos, meta)
    assert hidden.shape == (q_len, runner.hf_config.hidden_size) and hidden.isfinite().all()
    assert torch.equal(runner.kv_cache, before)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied / untied embeddings
def test_weight_bytes_read_the_lm_head_matrix_once_and_not_an_untied_embedding(arch, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    runner = LLMEngine(model=str(model_dir), num_kv_blocks=4).runner
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    c = hf.config
    lookup_only = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    assert weight_bytes(runner.model) == 4 * (hf.num_parameters() - lookup_only)


def test_tiny_cpu_smoke_run_fills_every_section(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the plain CPU run: no Triton interpreter
    args = build_parser().parse_args(["bench", "gpu", "--allow-cpu", "--tiny", "--device", "cpu", "--skip-hf",
                                      "--acceptance-rate", "0.7", "--num-speculative-tokens", "3", "--threads", "1",
                                      "--out", str(tmp_path)])
    assert args.func(args) == 0
    res = json.loads((tmp_path / "gpu-tiny.json").read_text())
    assert (tmp_path / "gpu-tiny.png").stat().st_size > 0
    assert res["throughput"]["ours"]["tok_per_s"] > 0
    ss = res["single_stream"]
    assert ss["engine_step_ms"] > 0 and ss["forward_ms"] > 0 and ss["bound_ms_measured_copy"] > 0
    spec = res["speculative"]
    assert "CPU" in spec["acceptance_rate_source"] and [r["k"] for r in spec["rows"]] == list(range(1, 9))
    assert spec["rows"][2]["tokens_per_iteration"] == pytest.approx(1 + 3 * 0.7)
    # on the CPU the kernel section is skipped, saying why, rather than run or reported as checked
    assert list(res["kernels"]) == ["skipped"] and "TRITON_INTERPRET=1" in res["kernels"]["skipped"]
