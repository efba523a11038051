"""EngineConfig refuses values a user can get wrong with `field: why` (exceptions, not asserts: they survive -O)."""
import pytest

from engine_service.engine.block_manager import BlockManager
from engine_service.engine.config import EngineConfig


@pytest.mark.parametrize("field,value", [
    ("dtype", "int8"), ("device", "tpu"), ("attention_backend", "flash"), ("block_size", 12), ("block_size", 0),
    ("kv_cache_memory", 0), ("num_kv_blocks", 0), ("num_kv_blocks", -3), ("max_num_seqs", 0),
    ("max_num_batched_tokens", 0), ("max_model_len", 0), ("max_beam_width", 0), ("num_threads", 0),
    ("kv_cache_dtype", "bf16"),
])
def test_bad_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        EngineConfig(**{"device": "cpu", field: value})


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_device_names_are_accepted(device):
    assert EngineConfig(device=device).device == device


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (8, 0)])
def test_block_manager_refuses_an_empty_pool(num_blocks, block_size):
    with pytest.raises(ValueError, match="^(num_blocks|block_size): "):
        BlockManager(num_blocks, block_size)


def test_the_kv_cache_dtype_auto_is_the_models_except_fp16_under_int8_weights_on_a_cpu():
    assert EngineConfig(device="cpu").kv_cache_dtype == "auto"  # float32: token-exact with HF
    assert EngineConfig(device="cpu", quantization="int8").kv_cache_dtype == "fp16"
    assert EngineConfig(device="cpu", quantization="int8", kv_cache_dtype="fp32").kv_cache_dtype == "fp32"
    assert EngineConfig(device="cpu", quantization="int8", kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert EngineConfig(device="cuda", quantization="int8").kv_cache_dtype == "auto"  # bf16 there
    with pytest.raises(ValueError, match="^kv_cache_dtype 'fp32' is for float32 models"):
        EngineConfig(device="cuda", kv_cache_dtype="fp32")
    with pytest.raises(ValueError, match="^kv_cache_dtype 'fp16' .* torch attention backend only"):
        EngineConfig(device="cpu", kv_cache_dtype="fp16", attention_backend="triton")
