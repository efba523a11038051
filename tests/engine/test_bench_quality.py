"""`decodelab bench quality` (engine_service/bench/quality.py) with tiny settings: the result's shape, the
held-out text's provenance, and the engine's perplexity from prompt log-probs equal to Hugging Face's on the
same chunks (HF is the oracle)."""
import math

import pytest
import torch

from engine_service.bench.quality import BAR, chunks, first_divergence, held_out_text, measure, plot, sentences
from engine_service.bench.quality import variants as quality_variants
from engine_service.engine.config import EngineConfig
from engine_service.engine.models.int8_linear import CALIBRATION_TEXT
from tests.hf_oracle import hf_model

TINY = dict(text_tokens=150, chunk_tokens=64, num_prompts=4, new_tokens=6)


@pytest.fixture(scope="module")
def result(tiny_llama_dir):
    return measure(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=8), held_out_text(), **TINY)


@torch.inference_mode()
def hf_perplexity(model_dir, pieces: list[list[int]]) -> float:
    model, total, n = hf_model(str(model_dir)), 0.0, 0
    for piece in pieces:
        lp = model(torch.tensor([piece])).logits[0].double().log_softmax(-1)
        total += float(lp[:-1].gather(1, torch.tensor(piece[1:])[:, None]).sum())
        n += len(piece) - 1
    return math.exp(-total / n)


def test_the_engines_perplexity_from_prompt_logprobs_is_hfs(result, tiny_llama_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(held_out_text().text, add_special_tokens=False).input_ids
    pieces = chunks(ids[:TINY["text_tokens"]], TINY["chunk_tokens"])
    assert len(pieces) == result["text"]["chunks"] == 3  # 150 tokens in chunks of 64: several requests
    assert result["variants"]["fp32"]["scored_tokens"] == TINY["text_tokens"] - len(pieces)
    assert result["variants"]["fp32"]["ppl"] == pytest.approx(hf_perplexity(tiny_llama_dir, pieces), rel=1e-3)


def test_every_variant_is_measured_against_the_baseline_or_skipped_with_its_reason(result):
    rows = result["variants"]
    assert list(rows) == [v.name for v in quality_variants("float32")] and result["baseline"] == "fp32"
    assert "rel_ppl_change" not in rows["fp32"] and rows["fp32"]["quantization"] is None
    for name, row in list(rows.items())[1:]:
        if "skipped" in row:
            assert name.endswith("kv") and "kv_cache_dtype" in row["skipped"]
            continue
        assert row["rel_ppl_change"] == pytest.approx(row["ppl"] / rows["fp32"]["ppl"] - 1)
        assert row["verdict"] == ("fails the 2% bar (not a default)" if row["rel_ppl_change"] > BAR
                                  else "within the 2% bar")
        div = row["divergence"]
        assert len(div["first_diff"]) == result["prompts"]["count"] == TINY["num_prompts"]
        assert sum(div["histogram"]) == TINY["num_prompts"] and len(div["histogram"]) == TINY["new_tokens"] + 1
        assert div["identical_fraction"] == div["first_diff"].count(TINY["new_tokens"]) / TINY["num_prompts"]
    assert "ppl" in rows["int8_weights"]  # int8 weights are in this tree


def test_the_plot_is_written(result, tmp_path):
    plot({"model": "tiny", **result}, tmp_path / "quality.png")
    assert (tmp_path / "quality.png").stat().st_size > 0


def test_the_held_out_text_is_fixed_english_prose_and_not_the_calibration_text():
    text = held_out_text()
    assert text.sha256 == held_out_text().sha256 and len(text.text.split()) > 2000
    assert "pydoc_data.topics" in text.source and CALIBRATION_TEXT[:40] not in text.text
    prompts = sentences(text.text, 50)
    assert len(prompts) == 50 == len(set(prompts)) and all(p[0].isupper() for p in prompts)


def test_first_divergence_is_the_first_differing_index_or_the_length():
    assert first_divergence([[1, 2, 3], [1, 2, 3], [4, 5, 6]], [[1, 2, 3], [1, 9, 3], [7, 5, 6]]) == [3, 1, 0]
